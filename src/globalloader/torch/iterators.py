"""The iterators `DataLoader.__iter__` returns: in the main process, or over a worker pool.

Both follow torch's iterator contract: each pass draws a base seed from the loader's generator
(or torch's global RNG), then walks the sampler or batch sampler in the main process; a sample's
error is raised for its own batch and the pass can go on; an iterable dataset's length, once
asked for, warns when more batches come than it announced. With workers, the Loader's task window
(`execution.window`) sends task `i` to worker `i mod num_workers` (skipping exhausted ones), keeps
`prefetch_factor` tasks per worker in flight, and yields batches in task order (or as they come
with `in_order=False`).

Each iterator times the loop as a Loader's run does (`execution.stats`: the wait in `next()`, the
loop's own time, each batch's stages), records in its `Progress` what `torch.resume` needs to
resume the pass exactly, and starts from a `Resume`: map-style datasets skip taken batches
without loading them, iterable ones load and drop them (the only way to advance them).
"""

from __future__ import annotations

import time
import traceback
import warnings
from typing import TYPE_CHECKING, Any

from globalloader.execution.window import TaskWindow
from globalloader.runtime.pool import WorkerPool, raised_again
from globalloader.torch.resume import Progress, Resume, past_the_end
from globalloader.torch.tensors import accelerator_available, pin, to_tensors, torch
from globalloader.torch.worker import BATCH, EXHAUSTED, FAILED, RESET, Fetcher, TorchBody, WorkerSpec, seed_datapipe

if TYPE_CHECKING:
    from globalloader.dataset.plan import Timer
    from globalloader.torch.settings import LoaderSettings


# ends the pool's timeout and death messages
_WAITING = " while loading a batch (with num_workers=0 the dataset's own error shows where)"


def _draw_seed(generator: Any) -> int:
    """A 64-bit seed from `generator` (None: torch's global RNG), drawn as torch's DataLoader does."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


class _BaseIter:
    """What both iterators share: the pass's seeds and sampler walk, the loop's clock, counting, the
    length warning, pinning."""

    def __init__(self, loader: LoaderSettings, progress: Progress, resume: Resume) -> None:
        # No reference to the loader: dropping a loader and its iterator must stop the workers at once.
        self._index_sampler = loader._index_sampler
        self._uses_workers = loader.num_workers > 0
        self._progress = progress
        self._stats = loader.statistics
        self._dataset = loader.dataset
        self._iterable = loader._dataset_kind_iterable
        self._auto_collation = loader._auto_collation
        self._pin = loader.pin_memory and accelerator_available()
        self._pin_device = loader.pin_memory_device
        self._datapipe = isinstance(loader.dataset, torch.utils.data.IterDataPipe)
        # torch's order of draws: a datapipe's shared seed, the sampler's, then the base seed
        self._shared_seed = _draw_seed(loader.generator) if self._datapipe else None
        self._start_pass(loader)
        if resume.fresh_workers:  # drawn as torch does, so the RNG streams match
            self._base_seed = _draw_seed(loader.generator)
            resume.check_drawn(self._base_seed)
        else:  # persistent workers past their first pass: they keep the seed they were started with
            self._base_seed = resume.base_seed  # type: ignore[assignment] # checked by check_state

    def _start_pass(self, loader: LoaderSettings) -> None:
        self._sampler_iter = iter(self._index_sampler)
        self._num_yielded = 0
        self._len_called = loader._IterableDataset_len_called
        self._last_yield: float | None = None  # when the loop last got a batch of this pass

    def __iter__(self) -> _BaseIter:
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)

    def _next_batch(self) -> Any:
        raise NotImplementedError

    def __next__(self) -> Any:
        start = time.perf_counter()
        if self._last_yield is not None:
            self._stats.consumer_busy(start - self._last_yield)
        self._last_yield = None
        try:
            batch = self._deliver(self._next_batch())
        except StopIteration:
            raise
        except Exception:
            self._took(start)  # a batch whose loading raised is taken too: the loop waited for it
            raise
        self._took(start)
        return batch

    def _took(self, start: float) -> None:
        self._last_yield = now = time.perf_counter()
        self._stats.consumer_wait(now - start)

    def _deliver(self, batch: Any) -> Any:
        self._num_yielded += 1
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

    def __init__(self, loader: LoaderSettings, progress: Progress, resume: Resume | None = None) -> None:
        resume = resume or Resume()
        super().__init__(loader, progress, resume)
        dataset = self._dataset
        if self._datapipe:
            dataset = seed_datapipe(dataset, self._shared_seed)
            torch.utils.data.graph_settings.apply_sharding(dataset, 1, 0)
        progress.base_seed = self._base_seed
        self._fetch = Fetcher(_spec(loader, dataset), dataset, default_collate=torch.utils.data.default_collate)
        for taken in range(resume.skip):
            try:
                self._next_batch(fetch=self._iterable)
            except StopIteration:
                raise past_the_end(resume.skip, taken) from None
            except Exception:  # noqa: BLE001 - a batch that raised when it was first taken: it counts, as it did then
                continue
        self._num_yielded = resume.skip

    def _next_batch(self, fetch: bool = True) -> Any:
        try:
            index = next(self._sampler_iter)
        except StopIteration:
            self._progress.done = True
            raise
        self._progress.batches += 1  # taken, even if loading it raises
        if not fetch:
            return None
        timer: Timer = {}
        batch = self._fetch(index, timer)
        self._stats.add_task(timer, 0.0, 0)
        return batch


class _BatchWorkers:
    """The DataLoader's worker processes as the task window sees them (`execution.window`): a task
    is a message, a result the worker's `Reply` with its batch mapped at once (once mapped, its
    worker may stop without taking it away). Closed, it ends the pass: StopIteration."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool: WorkerPool | None = pool

    def live(self) -> WorkerPool:
        if self.pool is None:
            raise StopIteration  # shut down: the pass is over
        return self.pool

    def submit(self, worker: int, message: Any) -> None:
        self.live().send(worker, message)

    def result(self, worker: int) -> Any:
        pool = self.live()
        return _mapped(pool, worker, pool.receive(worker, _WAITING))

    def result_any(self) -> tuple[int, Any]:
        pool = self.live()
        worker, reply = pool.receive_any(_WAITING)
        return worker, _mapped(pool, worker, reply)

    def close(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()


def _mapped(pool: WorkerPool, worker: int, reply: Any) -> Any:
    if reply[2] == BATCH:
        return (*reply[:3], pool.unpack(worker, reply[3]), *reply[4:])
    return reply


class WorkerIter(_BaseIter):
    """num_workers>0: a pool of worker processes, started per iterator or kept (persistent_workers)."""

    _batch_workers: _BatchWorkers | None = None  # None once shut down

    def __init__(self, loader: LoaderSettings, progress: Progress, resume: Resume | None = None) -> None:
        resume = resume or Resume()
        super().__init__(loader, progress, resume)
        self._num_workers = loader.num_workers
        self._prefetch = (loader.prefetch_factor or 2) * loader.num_workers
        self._in_order = loader.in_order
        self._timeout = loader.timeout
        self._persistent = loader.persistent_workers
        spec = _spec(loader, loader.dataset)
        self._default_collate = spec.collate_fn is None and self._auto_collation
        context = loader.multiprocessing_context or torch.multiprocessing.get_context()
        body = TorchBody(spec, self._base_seed, self._shared_seed, resume.workers)
        pool = WorkerPool(
            body, self._num_workers, context, self._timeout, name="DataLoader worker", setting="DataLoader(timeout=)"
        )
        self._batch_workers = _BatchWorkers(pool)
        self._workers = pool.procs
        self._generation = 0
        self._begin(progress, resume.fresh_workers, resume.workers, resume.skip)

    def _reset(self, loader: LoaderSettings, progress: Progress) -> None:
        """Start the next pass of persistent workers: a new sampler walk, fresh dataset iterators.

        Waits, as torch does, until every worker has begun the pass, so that whatever it drew
        for tasks of the pass before (prefetched, never delivered) is in the RNG state it reports.
        """
        pool = self._live_pool()
        self._start_pass(loader)
        self._generation += 1
        shared_seed = _draw_seed(loader.generator) if self._datapipe else None
        for w in range(self._num_workers):
            pool.send(w, ("reset", self._generation, 0, shared_seed))
        states: list[Any] = [None] * self._num_workers
        waiting = set(range(self._num_workers))
        while waiting:
            worker, (generation, _, kind, payload, _, _, rng) = pool.receive_any(_WAITING)
            if kind == RESET and generation == self._generation:
                states[worker] = rng
                waiting.discard(worker)
            elif kind == BATCH:  # a reply to the pass before: drop it
                pool.discard(worker, payload)
        self._begin(progress, False, states, 0)

    def _begin(self, progress: Progress, fresh: bool, states: list[Any] | None, skip: int) -> None:
        """Record where the pass starts, skip `skip` batches, send the first tasks.

        Every reply of the pass before was read by `_reset`, so what the window collects is this pass's.
        """
        self._progress = progress
        progress.base_seed, progress.fresh_workers = self._base_seed, fresh
        progress.workers = list(states) if states is not None else [None] * self._num_workers
        self._replaying = False
        if not self._iterable:  # skip taken batches without loading them
            for _ in range(skip):
                next(self._sampler_iter, None)
            progress.batches = skip
        self._sent = skip if not self._iterable else 0  # the next task's number
        # a skipped task's worker is where it would have run, so each worker's tasks (and RNG) are the same
        self._window: TaskWindow[tuple[str, int, int, Any]] = TaskWindow(
            self._live_batch_workers(), self._num_workers, self._prefetch, self._in_order, first=self._sent
        )
        self._fill()
        if self._iterable:  # the only way to advance an iterable: load its batches again, dropping them
            self._replaying = True
            for taken in range(skip):
                try:
                    self._next_batch()
                except StopIteration:
                    raise past_the_end(skip, taken) from None
            self._replaying = False
        self._num_yielded = skip

    def _fill(self) -> None:
        """Send tasks until `prefetch_factor * num_workers` are in flight or the sampler ends."""
        window = self._window
        while not window.full():
            try:
                index = next(self._sampler_iter)
            except StopIteration:
                return
            if window.submit(("task", self._generation, self._sent, index)) is None:
                return  # every worker is exhausted
            self._sent += 1

    def _next_batch(self) -> Any:
        window = self._window
        while True:
            self._live_batch_workers()
            if not window:
                self._progress.done = True
                if not self._persistent:
                    self.close()
                raise StopIteration
            _, worker, (_, _, kind, payload, timer, idle, rng) = window.collect()
            if kind == EXHAUSTED:
                window.retire(worker)
                if not self._persistent:
                    self._live_pool().stop(worker)
                self._fill()
                continue
            if kind == BATCH:
                self._stats.add_task(timer, idle, 0)
            return self._take(worker, kind, payload, rng)

    def _take(self, worker: int, kind: int, payload: Any, rng: Any) -> Any:
        self._progress.batches += 1  # taken, even if it raised
        # Where this worker's next task starts from. None: unchanged since its previous task, which
        # was delivered before this one (a worker's replies are delivered in the order it sent them).
        if rng is not None:
            self._progress.workers[worker] = rng  # type: ignore[index] # set by _begin
        self._fill()
        if kind == FAILED:
            if self._replaying:  # it raised when it was first taken; not again
                return None
            exc, tb = payload
            raise raised_again(exc, tb and f"in DataLoader worker {worker}:\n{tb}")
        return to_tensors(payload) if self._default_collate else payload

    def _live_batch_workers(self) -> _BatchWorkers:
        if self._batch_workers is None:
            raise StopIteration  # shut down: the pass is over
        return self._batch_workers

    def _live_pool(self) -> WorkerPool:
        return self._live_batch_workers().live()

    def __next__(self) -> Any:
        try:
            return super().__next__()
        except Exception as exc:
            # The frames below hold the error in their locals: a cycle (error -> traceback -> frame
            # -> error) that would keep this iterator and its workers alive until the garbage
            # collector runs, maybe in a process forked by then. Without it, dropping the error frees them.
            if exc.__traceback__ is not None:
                traceback.clear_frames(exc.__traceback__.tb_next)
            raise

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers now (also what `del` of the iterator does)."""
        workers, self._batch_workers = self._batch_workers, None
        if workers is not None:
            workers.close()


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
