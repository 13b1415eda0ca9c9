"""The worker process of the drop-in DataLoader: torch's worker contract, shared-memory output.

A worker gets its copy of the dataset once, at start; then, for each task (an index batch of a
map-style dataset, or "next batch" of an iterable one) it fetches, collates and writes the batch
into a shared-memory segment, sending back a message of a few hundred bytes with the seconds it
waited for the task and its time per stage (`fetch`, `collate`, `transport`: the figures a
Loader's workers send, `execution.stats`; three clock reads per batch, none per sample).

What a dataset sees is what torch documents: `torch.utils.data.get_worker_info()` gives the
worker's id, count, seed and dataset copy; `torch`, `random` and `numpy` are seeded from the
iterator's base seed and the worker id; `worker_init_fn(worker_id)` runs once, after seeding.
For resume, a worker of a map-style dataset reports the state of those three RNGs after each task
(the state its next task starts from), and one started to resume a pass puts back the state it
is given before its first task. The process itself (start, death, timeout, parent death, one
intra-op thread) is `runtime.WorkerPool`'s; this module is only the body it runs.
"""

from __future__ import annotations

import random
import reprlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from globalloader.errors import UNPICKLABLE, TransformError, WorkerError, unsendable
from globalloader.runtime.pool import Worker, failure
from globalloader.torch.collate import stack_collate
from globalloader.torch.rng import RngReporter, set_process_rng
from globalloader.torch.tensors import torch

if TYPE_CHECKING:
    from globalloader.dataset.plan import Timer

# A worker's reply to each message, a plain tuple (a named one costs microseconds more to pickle):
# (generation, task or -1 for RESET, kind, payload, timer: stage -> [items, seconds] of a BATCH or
# None, seconds the worker waited for the message, its RNG states where its next task starts or None)
Reply = tuple[int, int, int, Any, "Timer | None", float, Any]
BATCH = 0  # payload: a batch packed by `runtime.Worker.pack`
FAILED = 1  # payload: (exception, traceback text)
EXHAUSTED = 2  # an iterable dataset's copy in this worker has no more items
RESET = 4  # the worker has started a new pass (persistent workers); its RNG state comes along


class WorkerSpec(NamedTuple):
    """Everything a worker needs, sent once when it starts."""

    dataset: Any
    iterable: bool  # an IterableDataset: each worker iterates its own copy
    auto_collation: bool  # batches of samples (batch_size or batch_sampler set)
    batch_size: int | None  # for iterable datasets with auto-collation
    drop_last: bool
    collate_fn: Callable[[Any], Any] | None  # None: torch's default (lazily stacked)
    worker_init_fn: Callable[[int], None] | None
    num_workers: int


def worker_seeds(base_seed: int, worker_id: int) -> tuple[int, np.ndarray]:
    """(seed for `torch` and `random`, state for `numpy.random`) of one worker, as torch derives them.

    NumPy's seed is a SeedSequence of (worker id, base seed), so workers never share a NumPy
    stream even though their torch seeds differ by one.
    """
    return base_seed + worker_id, np.random.SeedSequence([worker_id, base_seed]).generate_state(4)


class TorchBody:
    """A DataLoader worker's body (`runtime.WorkerPool`): seed, set up the dataset copy, then one
    `Reply` per message."""

    def __init__(
        self, spec: WorkerSpec, base_seed: int, shared_seed: int | None, rng: list[dict[str, Any] | None] | None
    ) -> None:
        """`rng[w]`: the RNG states (`rng.process_rng`) worker `w` starts its first task from instead
        of the freshly seeded ones: the worker resumes a pass its predecessor had begun."""
        self.spec, self.base_seed, self.shared_seed, self.rng = spec, base_seed, shared_seed, rng

    def setup(self, worker: Worker) -> None:
        spec, worker_id = self.spec, worker.index
        seed, numpy_state = worker_seeds(self.base_seed, worker_id)
        random.seed(seed)
        torch.manual_seed(seed)
        np.random.seed(numpy_state)
        self.dataset = spec.dataset
        self.datapipe = isinstance(self.dataset, torch.utils.data.IterDataPipe)
        if self.datapipe:
            self.dataset = seed_datapipe(self.dataset, self.shared_seed)
        torch.utils.data._utils.worker._worker_info = torch.utils.data._utils.worker.WorkerInfo(
            id=worker_id, num_workers=spec.num_workers, seed=seed, dataset=self.dataset
        )
        self.fetch: Fetcher | None = None
        self.setup_error: tuple[BaseException, str] | None = None
        try:
            if self.datapipe:
                torch.utils.data.graph_settings.apply_sharding(self.dataset, spec.num_workers, worker_id)
            if spec.worker_init_fn is not None:
                spec.worker_init_fn(worker_id)
            self.fetch = Fetcher(spec, self.dataset)
        except Exception as exc:  # noqa: BLE001 - the user's setup failed: reported as the first task's result, as torch does
            self.setup_error = failure(exc, WorkerError)
        if self.rng is not None and self.rng[worker_id] is not None:
            # after worker_init_fn: what it drew is part of the state being restored
            set_process_rng(self.rng[worker_id], "worker rng")
        # An iterable dataset resumes by replaying its batches (RNG draws included): no report per task.
        self.reporter = None if spec.iterable else RngReporter()
        self.idle_since = time.perf_counter()

    def run(self, worker: Worker, message: tuple[str, int, int, Any]) -> None:
        idle = time.perf_counter() - self.idle_since
        reply = self._reply(worker, message, idle)
        try:
            worker.send(reply, reply[3] if reply[2] == BATCH else None)
        except UNPICKLABLE as exc:
            at = "" if self.spec.iterable else f" (index {reprlib.repr(message[3])})"
            refused = TransformError(
                unsendable(
                    f"the batch of {type(self.dataset).__name__}{at} (its samples or collate_fn's output) cannot be "
                    f"sent from worker {worker.index} to the loop",
                    exc,
                    "return picklable values (tensors, arrays, numbers, str) or use num_workers=0",
                )
            )
            worker.send((*reply[:2], FAILED, (refused, ""), None, *reply[5:]))
        self.idle_since = time.perf_counter()

    def _reply(self, worker: Worker, message: tuple[str, int, int, Any], idle: float) -> Reply:
        op, generation, number, payload = message
        if op == "reset":  # persistent workers, next pass
            if self.datapipe:
                self.dataset = seed_datapipe(self.dataset, payload)
            try:
                self.fetch = Fetcher(self.spec, self.dataset)
                self.setup_error = None
            except Exception as exc:  # noqa: BLE001 - the dataset's __iter__ failed: reported as the next result
                self.setup_error = failure(exc, WorkerError)
            reset_reporter = RngReporter()  # the full state: the consumer starts the pass from it
            self.reporter = None if self.spec.iterable else reset_reporter
            return (generation, -1, RESET, None, None, idle, reset_reporter.changed())
        timer: Timer | None = None
        if self.setup_error is not None or self.fetch is None:
            kind, payload, self.setup_error = FAILED, self.setup_error or _no_fetcher(), None
        else:
            try:
                timer = {}
                batch = self.fetch(payload, timer)
                start = time.perf_counter()
                kind, payload = BATCH, worker.pack(batch)
                timer["transport"] = [1, time.perf_counter() - start]
            except StopIteration:
                kind, payload, timer = EXHAUSTED, None, None
            except Exception as exc:  # noqa: BLE001 - whatever the dataset or collate raised goes to the consumer
                kind, payload, timer = FAILED, failure(exc, WorkerError), None
        rng = None if self.reporter is None else self.reporter.changed()  # where its next task starts
        return (generation, number, kind, payload, timer, idle, rng)


class Fetcher:
    """One batch (or sample) from a map-style dataset's indices, or the next from an iterable."""

    def __init__(self, spec: WorkerSpec, dataset: Any, default_collate: Callable[[Any], Any] = stack_collate) -> None:
        self.spec, self.dataset = spec, dataset
        self.items = iter(dataset) if spec.iterable else None  # may raise: the dataset's __iter__
        if spec.collate_fn is not None:
            self.collate = spec.collate_fn
        elif spec.auto_collation:
            self.collate = default_collate
        else:
            self.collate = torch.utils.data.default_convert
        self.getitems = getattr(dataset, "__getitems__", None)

    def __call__(self, index: Any, timer: Timer) -> Any:
        """The batch (or sample) for `index`; adds its `fetch` and `collate` seconds to `timer`."""
        spec, start = self.spec, time.perf_counter()
        if self.items is not None:
            if not spec.auto_collation:
                data = next(self.items)  # StopIteration ends this worker's share
            else:
                data, size = [], spec.batch_size or 1
                for item in self.items:
                    data.append(item)
                    if len(data) == size:
                        break
                if not data or (spec.drop_last and len(data) < size):
                    raise StopIteration
        elif not spec.auto_collation:
            data = self.dataset[index]
        else:
            data = self.getitems(index) if self.getitems else [self.dataset[i] for i in index]
        fetched = time.perf_counter()
        batch = self.collate(data)
        timer["fetch"] = [len(data) if spec.auto_collation and hasattr(data, "__len__") else 1, fetched - start]
        timer["collate"] = [1, time.perf_counter() - fetched]
        return batch


def seed_datapipe(dataset: Any, shared_seed: int | None) -> Any:
    """Seed a datapipe's random operations from `shared_seed`, the same in every worker (torch's shared seed)."""
    rng = torch.Generator()
    rng.manual_seed(shared_seed if shared_seed is not None else 0)
    return torch.utils.data.graph_settings.apply_random_seed(dataset, rng)


def _no_fetcher() -> tuple[BaseException, str]:
    return WorkerError("the worker could not set up its dataset (its error was reported earlier)"), ""
