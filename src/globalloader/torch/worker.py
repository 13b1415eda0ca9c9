"""The worker process of the drop-in DataLoader: torch's worker contract, shared-memory output.

A worker gets its copy of the dataset once, at start; then, for each task (an index batch of a
map-style dataset, or "next batch" of an iterable one) it fetches, collates and writes the batch
into a shared-memory segment (`transport.segments`), sending back a message of a few hundred bytes.

What a dataset sees is what torch documents: `torch.utils.data.get_worker_info()` gives the
worker's id, count, seed and dataset copy; `torch`, `random` and `numpy` are seeded from the
iterator's base seed and the worker id; `worker_init_fn(worker_id)` runs once, after seeding.
For resume, a worker of a map-style dataset reports the state of those three RNGs after each task
(the state its next task starts from), and one started to resume a pass puts back the state it
is given before its first task.
Intra-op threads are set to one first thing, so a worker forked after the main process used
torch's thread pool never waits on threads that fork did not copy. A watchdog thread ends the
worker within half a second of its parent's death, even while the dataset code is stuck.
"""

from __future__ import annotations

import os
import pickle
import random
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import numpy as np

from globalloader.errors import WorkerError
from globalloader.torch.collate import stack_collate
from globalloader.torch.rng import RngReporter, set_process_rng
from globalloader.torch.tensors import torch
from globalloader.transport.codec import copy_arrays, encode_tree
from globalloader.transport.names import remove_leftovers
from globalloader.transport.process import single_threaded_torch, tune_allocator
from globalloader.transport.segments import BatchWriter

# Result kinds a worker sends: (generation, task, kind, payload, busy seconds, RNG state or None)
BATCH = 0  # payload: a BatchMessage
FAILED = 1  # payload: (exception, traceback text)
EXHAUSTED = 2  # an iterable dataset's copy in this worker has no more items
INLINE = 3  # payload: (encoded tree, bytearray of its arrays): a batch too small for a segment
RESET = 4  # the worker has started a new pass (persistent workers); its RNG state comes along

# Batches with fewer array bytes travel inside the message: cheaper than a segment round trip, and
# a loop that keeps many small batches alive holds no mapping (nor file descriptor) per batch.
INLINE_BYTES = 64 << 10

_WATCHDOG_PERIOD = 0.5  # seconds between checks that the parent is alive


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


def worker_main(
    spec: WorkerSpec,
    conn: Connection,
    worker_id: int,
    base_seed: int,
    shared_seed: int | None,
    prefix: str,
    main_pid: int,
    rng: dict[str, Any] | None = None,
) -> None:
    """Run tasks from `conn` until told to stop (None), the pipe closes, or the parent dies.

    `rng`: the RNG states (`rng.process_rng`) to start the first task from, instead of the
    freshly seeded ones: the worker resumes a pass its predecessor had begun.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    single_threaded_torch()  # before any torch op: the parent's thread pool did not survive the fork
    _watch_parent(main_pid, prefix)
    tune_allocator()
    seed, numpy_state = worker_seeds(base_seed, worker_id)
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(numpy_state)
    dataset = spec.dataset
    datapipe = isinstance(dataset, torch.utils.data.IterDataPipe)
    if datapipe:
        dataset = _seed_datapipe(dataset, shared_seed)
    torch.utils.data._utils.worker._worker_info = torch.utils.data._utils.worker.WorkerInfo(
        id=worker_id, num_workers=spec.num_workers, seed=seed, dataset=dataset
    )
    writer = BatchWriter(prefix)
    fetch: Fetcher | None = None
    failure: tuple[BaseException, str] | None = None
    try:
        if datapipe:
            torch.utils.data.graph_settings.apply_sharding(dataset, spec.num_workers, worker_id)
        if spec.worker_init_fn is not None:
            spec.worker_init_fn(worker_id)
        fetch = Fetcher(spec, dataset)
    except Exception as exc:  # noqa: BLE001 - the user's setup failed: reported as the first task's result, as torch does
        failure = (exc, traceback.format_exc())
    if rng is not None:  # after worker_init_fn: what it drew is part of the state being restored
        set_process_rng(rng, "worker rng")
    # An iterable dataset resumes by replaying its batches (RNG draws included): no report per task.
    reporter = None if spec.iterable else RngReporter()
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                return
            op, generation, number, payload, freed = msg
            writer.free(freed)
            if op == "reset":  # persistent workers, next pass
                if datapipe:
                    dataset = _seed_datapipe(dataset, payload)
                try:
                    fetch = Fetcher(spec, dataset)
                    failure = None
                except Exception as exc:  # noqa: BLE001 - the dataset's __iter__ failed: reported as the next result
                    failure = (exc, traceback.format_exc())
                reset_reporter = RngReporter()  # the full state: the consumer starts the pass from it
                conn.send_bytes(pickle.dumps((generation, -1, RESET, None, 0.0, reset_reporter.changed())))
                reporter = None if spec.iterable else reset_reporter
                continue
            start = time.perf_counter()
            reply: tuple[int, int, int, Any, float]
            if failure is not None or fetch is None:
                reply = (generation, number, FAILED, _sendable(*(failure or _no_fetcher())), 0.0)
                failure = None
            else:
                try:
                    kind, message = _pack(fetch(payload), writer)
                    reply = (generation, number, kind, message, time.perf_counter() - start)
                except StopIteration:
                    reply = (generation, number, EXHAUSTED, None, 0.0)
                except Exception as exc:  # noqa: BLE001 - whatever the dataset or collate raised goes to the consumer
                    reply = (generation, number, FAILED, _sendable(exc, traceback.format_exc()), 0.0)
            state = None if reporter is None else reporter.changed()
            conn.send_bytes(pickle.dumps((*reply, state), protocol=pickle.HIGHEST_PROTOCOL))
    except (EOFError, BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        return
    finally:
        writer.close()


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

    def __call__(self, index: Any) -> Any:
        spec = self.spec
        if self.items is not None:
            if not spec.auto_collation:
                return self.collate(next(self.items))  # StopIteration ends this worker's share
            data, size = [], spec.batch_size or 1
            for item in self.items:
                data.append(item)
                if len(data) == size:
                    break
            if not data or (spec.drop_last and len(data) < size):
                raise StopIteration
            return self.collate(data)
        if not spec.auto_collation:
            return self.collate(self.dataset[index])
        data = self.getitems(index) if self.getitems else [self.dataset[i] for i in index]
        return self.collate(data)


def _pack(batch: Any, writer: BatchWriter) -> tuple[int, Any]:
    """(INLINE, (tree, bytes)) for a small batch, else (BATCH, message) with its arrays in shared memory."""
    tree, placed, nbytes = encode_tree(batch)
    if nbytes > INLINE_BYTES:
        return BATCH, writer.write(batch)
    data = bytearray(nbytes)
    copy_arrays(data, 0, placed)
    return INLINE, (tree, data)


def _seed_datapipe(dataset: Any, shared_seed: int | None) -> Any:
    """Seed a datapipe's random operations the same way in every worker (torch's shared seed)."""
    rng = torch.Generator()
    rng.manual_seed(shared_seed if shared_seed is not None else 0)
    return torch.utils.data.graph_settings.apply_random_seed(dataset, rng)


def _no_fetcher() -> tuple[BaseException, str]:
    return WorkerError("the worker could not set up its dataset (its error was reported earlier)"), ""


def _sendable(exc: BaseException, tb: str) -> tuple[BaseException, str]:
    """The exception itself when it pickles, else a WorkerError naming its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure to pickle or unpickle means it cannot cross the pipe
        exc = WorkerError(f"{type(exc).__name__}: {exc}")
    return exc, tb


def _watch_parent(main_pid: int, prefix: str) -> None:
    """End this process soon after the main process dies, whatever its main thread is doing
    (unlinking the segments it wrote that nobody will read)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(_WATCHDOG_PERIOD)
            try:
                os.kill(main_pid, 0)
                orphaned = os.getppid() != parent
            except ProcessLookupError:
                orphaned = True
            if orphaned:
                remove_leftovers(prefix)
                os._exit(1)

    threading.Thread(target=watch, name="globalloader-watchdog", daemon=True).start()
