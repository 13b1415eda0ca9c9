"""A chain compiled for execution: which source indices a task covers and how to build it.

The unit of work is a task: one batch (or, for an unbatched chain, a chunk of `CHUNK` samples).
Task `t` of an epoch always covers the same positions and every random operator is seeded by
(root seed, epoch, index, position), so a task's output is a pure function of (chain, epoch, t):
the same for any number of workers, in threads or processes, and after a resume. Everything that
runs a chain (the sequential iterator, the Loader's workers, the global loader's clients) calls
`run_task`. Operators join the plan themselves (`dataset.operator`); the plan checks their order.

This module holds what both kinds of chain share. Each kind has its plan, holding its own
operators: a random-access chain's (`dataset.index_plan`) maps a task's positions to source
indices through its index operators, asking each only what `IndexOp` declares; a stream chain's
(`dataset.stream_plan`) reads its records in turn through its stream operators. The chain
(`Dataset.plan`) chooses one: the only place that tells the kinds apart.
"""

from __future__ import annotations

import pickle
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from globalloader import _slots
from globalloader._seeding import derive
from globalloader.dataset.batch import BatchOp
from globalloader.dataset.cache import MISSING, CacheOp
from globalloader.dataset.collate import collate as default_collate
from globalloader.dataset.combine import Combined
from globalloader.dataset.fingerprint import digest, fingerprint
from globalloader.dataset.operator import IndexOp, RecordOp, StreamOp, TailOp
from globalloader.dataset.seeds import SeedOp
from globalloader.dataset.stream import StreamReader
from globalloader.dataset.tail import TailRecord
from globalloader.errors import (
    SAMPLE_ERRORS,
    UNPICKLABLE,
    ArgumentError,
    GlobalLoaderError,
    TransformError,
    unsendable,
)
from globalloader.sampling.sharding import ShardArgs

CHUNK = 32  # samples per task when the chain has no batch: enough to amortize transport
GROUPED_CHUNK = 128  # samples per task feeding a tail: records are small (tokens), tasks many
# The wording for a cache() out of place, or on a stream (which has no index to key it by).
CACHE_PLACE = "cache() may appear once, before batch(), on a random-access source"

Timer = dict[str, list[float]]  # stage name -> [items, busy seconds]


@dataclass
class TaskResult:
    """What a task produced: a batch (None if every sample was skipped), a list of samples, or
    for a chain with a tail the (index, records) group of every sample."""

    output: Any
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (index, "key: error")


def _record_key(record: Any, index: int) -> str:
    key = record.get("__key__") if isinstance(record, dict) else None
    return f"index {index} (key {key!r})" if key is not None else f"index {index}"


class Plan(ABC):
    """The compiled form of a `Dataset`'s operator list; validates operator order once. What
    both kinds of chain share: the per-sample maps, the batch, the tail, the identity, the
    running of a task. Each kind of chain has its own: `IndexPlan` (`dataset.index_plan`) and
    `StreamPlan` (`dataset.stream_plan`); `Dataset.plan` chooses."""

    # Asked only where a kind's rule differs outside the plan: what a state holds (`dataset.resume`)
    # and a worker's wording for records it cannot send back.
    is_stream: ClassVar[bool]
    _read_task: Callable[[int, int, Any, bool, Timer, bool, bool], TaskResult]  # a task of its own items
    # What `len()` of a chain whose items are not known before it runs calls it.
    unsized: ClassVar[str]

    def __init__(self, source: Any, ops: Sequence[Any], inherited_seed: int | None) -> None:
        self.source = source
        self.maps: list[RecordOp] = []  # per-sample operators run by the workers, in order
        self.cache: CacheOp | None = None
        self.cache_at = 0  # maps before the cache point
        self.batch: BatchOp | None = None  # collated in the worker
        self.batch_maps: list[RecordOp] = []
        self.tail: list[TailOp] = []  # run in the consumer across tasks
        self._combined: Combined | None = None
        self._batched = False
        seeds = [op.seed for op in ops if isinstance(op, SeedOp)]
        if len(seeds) > 1:
            raise ArgumentError(f"seed() may appear once in a chain, got seeds {seeds}")
        self.seed = seeds[0] if seeds else inherited_seed or 0
        self._streams: Counter[str] = Counter()
        for op in ops:
            op.attach(self)
        self._source_ids: dict[bool, str] = {}

    def _take_identity(self) -> None:
        """Taken as the chain is built (call once its source is final): state a map updates as it
        runs (a memo dict, a lazily loaded model) must not make a checkpoint of this very chain
        look foreign. Its parts too: the elastic resume check (`dataset.resume`) names those that
        differ."""
        self.resume_parts = self.identity_parts(strict=False)
        self.resume_fingerprint = digest(*self.resume_parts.values())

    # -- the chain's operators, in the forms of its kind ---------------------------------------
    @abstractmethod
    def select_op(self, indices: Any) -> IndexOp: ...

    @abstractmethod
    def shuffle_op(self, seed: int | None, buffer_size: int | None, window: int | None) -> IndexOp | StreamOp: ...

    @abstractmethod
    def shard_op(self, rank: int, world_size: int, uneven: str) -> IndexOp | StreamOp: ...

    # -- operators join (see dataset.operator) ---------------------------------------------------
    def stream_seed(self, kind: str) -> int:
        """The seed of the next random operator of `kind` without an explicit one."""
        k = self._streams[kind]
        self._streams[kind] += 1
        return derive(self.seed, kind, k)

    def _order_op_fits(self, op: IndexOp | StreamOp) -> str:
        """The operator's name, once it is where an operator ordering samples may stand."""
        name = str(op.describe()[0])
        if self._batched or self.tail or self.expands:
            raise ArgumentError(f"{name} must come before batch, filter, flat_map, pack and bucket_batch in the chain")
        return name

    @abstractmethod
    def add_index(self, op: IndexOp) -> None: ...

    @abstractmethod
    def add_stream_op(self, op: StreamOp) -> None: ...

    def add_record(self, op: RecordOp) -> None:
        if self.tail or (self.batch is not None and op.expands):
            self.tail.append(TailRecord(op, len(self.tail)))
        elif self.batch is not None:
            self.batch_maps.append(op)
        else:
            if op.shared and any(m.random or m.expands for m in self.maps):
                raise ArgumentError(
                    f"map {op.name!r}: shared=True maps must come before any random map, filter or flat_map"
                )
            self.maps.append(op)

    def set_cache(self, op: CacheOp) -> None:
        if self.cache is not None or self._batched or self.tail:
            raise ArgumentError(CACHE_PLACE)
        if any(m.random or m.expands for m in self.maps):
            raise ArgumentError(
                "cache() must come before any random map, filter or flat_map (its output must be deterministic)"
            )
        self.cache, self.cache_at = op, len(self.maps)

    def set_batch(self, op: BatchOp) -> None:
        if self._batched:
            raise ArgumentError("batch() may appear only once in a chain")
        self._batched = True
        if self.tail or self.expands:
            self.tail.append(op)  # how many samples a task keeps is not known: batches are cut in the consumer
        else:
            self.batch = op

    def add_tail(self, op: TailOp, name: str) -> None:
        if self._batched:
            raise ArgumentError(f"{name} must come before batch() in the chain")
        self.tail.append(op)

    @property
    def expands(self) -> bool:
        """A worker's sample may make no record or several (filter, flat_map)."""
        return any(m.expands for m in self.maps)

    @property
    def grouped(self) -> bool:
        """Workers return (index, records) groups for the consumer's tail (`dataset.tail`)."""
        return bool(self.tail) or self.expands

    @property
    @abstractmethod
    def combinable(self) -> bool:
        """It may be a part of concat, mix or zip: random access, index operators and maps only."""

    @property
    @abstractmethod
    def source_length(self) -> int | None:
        """Source indices are below this (None: a stream's records have no index)."""

    @abstractmethod
    def check_shareable(self) -> None:
        """An ArgumentError saying why unless jobs may share this chain's samples (share=True)."""

    # -- identity: the sharing key, the disk cache's folder and the resume check ---------------
    @property
    def fingerprint(self) -> str:
        """Equal for chains whose outputs are equal (the sharing key); raises FingerprintError,
        naming the map or source, when a value deciding the output cannot be established."""
        return self.identity(strict=True)

    def identity(self, strict: bool) -> str:
        """Strict: the sharing key. Lenient (`resume_fingerprint`, the state_dict check): the same
        walk, except that values whose state cannot be seen (a lock a lambda captured) count by
        their type only, so any chain can be checkpointed."""
        return digest(*self.identity_parts(strict).values())

    def identity_parts(self, strict: bool) -> dict[str, Any]:
        """What `identity` digests, by part (the elastic resume check names the parts that differ)."""
        batch = self.batch
        return {
            "seed": self.seed,
            "source": self._source_identity(strict),
            "index": self.order_identity(placed=True),
            "maps": [(type(m).__name__, m.identity(strict), m.shared) for m in self.maps],
            "batch": None if batch is None else batch.identity(strict),
            "batch_maps": [(type(m).__name__, m.identity(strict)) for m in self.batch_maps],
            "tail": [(type(op).__name__, op.identity(strict)) for op in self.tail],
        }

    @abstractmethod
    def order_identity(self, placed: bool) -> list[tuple[object, ...]]:
        """The descriptions of the operators that order the samples (index or stream operators);
        without `placed`, leaving out what an elastic resume may change (the rank's share)."""

    def _source_identity(self, strict: bool) -> str:
        """Its `fingerprint` string, else a walk of its content (kept: sources do not change)."""
        if strict not in self._source_ids:
            self._source_ids[strict] = self._identify_source(strict)
        return self._source_ids[strict]

    @abstractmethod
    def _identify_source(self, strict: bool) -> str: ...

    @staticmethod
    def _walk_source(source: Any, strict: bool) -> str:
        fix = "Give the source a `fingerprint` attribute: a string that changes whenever its records do"
        return fingerprint(source, f"the source ({type(source).__name__})", fix, strict)

    @abstractmethod
    def shard(self) -> tuple[int, ShardArgs | None]:
        """The number of operators before the first shard (they make the epoch's global order)
        and its arguments, which a state records (None: no shard, or a stream's, whose state
        loads only into the same chain, rank and world size)."""

    # -- sizes -------------------------------------------------------------------------------
    @property
    @abstractmethod
    def samples(self) -> int | None:
        """Samples per epoch after the index operators (None for a stream of unknown length)."""

    @property
    def task_size(self) -> int:
        if self.batch is not None:
            return self.batch.size
        return GROUPED_CHUNK if self.grouped else CHUNK

    def num_tasks(self) -> int | None:
        return None if self.samples is None else self.tasks_for(self.samples)

    def tasks_for(self, samples: int) -> int:
        """Tasks that `samples` samples make (batches, or chunks of `task_size`)."""
        return self.batch.count(samples) if self.batch is not None else -(-samples // self.task_size)

    def items_per_epoch(self) -> int | None:
        """What one epoch yields: batches for a batched chain, else samples (None: not known
        before running, after a filter, flat_map, pack or bucket_batch)."""
        if self.grouped:
            return None
        return self.num_tasks() if self.batch is not None else self.samples

    @abstractmethod
    def stream_reader(self, epoch: int, skip_tasks: int = 0) -> StreamReader | None:
        """The tasks of an epoch of a stream chain, in turn, after `skip_tasks` of them (None: a
        random-access chain addresses its tasks by number instead, `IndexPlan.task_indices`)."""

    @property
    def split(self) -> int:
        """How many leading maps are shared (deterministic, shareable across jobs)."""
        return max((k + 1 for k, m in enumerate(self.maps) if m.shared), default=0)

    def sample(self, epoch: int, index: int, timer: Timer) -> Any:
        """Source index `index` through every per-sample map (chains that do not expand)."""
        return self._sample(epoch, index, MISSING, timer)

    def map_records(self, epoch: int, items: Iterable[tuple[int, Any]]) -> list[Any]:
        """What the per-sample maps make of source records `(index, record)` in `epoch`, in the
        order given: one record each, none for a sample a filter drops, a flat_map's records in
        turn; values equal to a task's, for an engine that reads the source itself (Ray's map tasks)."""
        timer: Timer = {}
        if not self.expands:
            return [self._sample(epoch, index, record, timer) for index, record in items]
        return [out for index, record in items for out in self._records(epoch, index, record, timer, 0)]

    def prefix_sample(self, index: int, timer: Timer | None = None) -> Any:
        """A sample after the shared maps only: what the global loader's server computes."""
        return self._sample(0, index, MISSING, {} if timer is None else timer, stop=self.split)

    # -- running a task ----------------------------------------------------------------------
    def run_task(
        self,
        epoch: int,
        task: int,
        items: np.ndarray | list[Any] | None,
        skip_errors: bool = False,
        timer: Timer | None = None,
        first_map: int | None = None,
        deferred: bool = False,
        sendable: bool = False,
    ) -> TaskResult:
        """Build task `task` from source indices (None: the task's own, `task_indices`), or from
        (index, record) pairs whose records already went through the first `first_map` maps
        (stream records; records served by the global loader: the shared prefix, possibly no map
        at all). `deferred`: leave the default collate's stacks for the shared-memory transport
        to fill. `sendable`: a sample that cannot be pickled (to leave a worker process) is a
        TransformError naming its last map, skipped as any other with `skip_errors`; it costs a
        pickle per sample, so a process worker asks for it only once a task's output failed to."""
        timer = {} if timer is None else timer
        if first_map is not None:
            return self._build(epoch, task, items, True, first_map, skip_errors, timer, deferred, sendable)
        return self._read_task(epoch, task, items, skip_errors, timer, deferred, sendable)

    def _build(
        self,
        epoch: int,
        task: int,
        items: Any,
        pairs: bool,
        first_map: int,
        skip_errors: bool,
        timer: Timer,
        deferred: bool,
        sendable: bool,
    ) -> TaskResult:
        """Samples from indices, or from (index, record) pairs whose records went through the
        first `first_map` maps; then the batch."""
        result = TaskResult(None)
        samples: list[Any] = []
        grouped = self.grouped
        default = self.batch is not None and self.batch.collate is default_collate
        # Samples written in their batch rows (no collate copy), unless the transport stacks them
        # into shared memory anyway; rows only after the cache point (`_sample` opens them).
        slotted = default and not grouped and not deferred
        with _slots.batch_slots(len(items)) if slotted else nullcontext() as slots:
            for item in items:
                index, record = (item[0], item[1]) if pairs else (int(item), MISSING)
                if slots is not None:
                    slots.start(len(samples), open=self.cache is None)
                try:
                    start = 0 if record is MISSING else first_map
                    if grouped:
                        sample: Any = (index, self._records(epoch, index, record, timer, start))
                    else:
                        sample = self._sample(epoch, index, record, timer, start)
                    if sendable:
                        self._check_sendable(sample, index)
                    samples.append(sample)
                except SAMPLE_ERRORS as exc:  # only a sample's own fault is skipped, never the machinery's
                    if not skip_errors:
                        raise
                    result.skipped.append((index, f"{type(exc).__name__}: {exc}"))
            if self.batch is None:
                result.output = samples
                return result
            if not samples:
                return result
            t0 = time.perf_counter()
            if deferred and default and not self.batch_maps:
                batch = default_collate(samples, deferred=True)
            else:
                batch = self.batch.collate(samples)
            tick(timer, "collate", t0)
        result.output = self._batch_maps(batch, epoch, task, timer)
        return result

    def _check_sendable(self, sample: Any, index: int) -> None:
        """A TransformError naming the map that made `sample` unless it can be pickled."""
        try:
            pickle.dumps(sample, protocol=pickle.HIGHEST_PROTOCOL)
        except UNPICKLABLE as exc:
            made_by = f"map {self.maps[-1].name!r}" if self.maps else "the source"
            what = f"{made_by} returned, for sample {_record_key(sample, index)}, a value a worker process cannot send"
            fix = "return picklable values (arrays, numbers, str and containers of them) or use Loader(mode='thread')"
            raise TransformError(unsendable(what, exc, fix)) from None

    def _batch_maps(self, batch: Any, epoch: int, task: int, timer: Timer) -> Any:
        for k, op in enumerate(self.batch_maps, start=len(self.maps)):
            batch = self._apply(op, batch, epoch, task, k, timer, batch_level=True)
        return batch

    def _sample(
        self, epoch: int, index: int, record: Any, timer: Timer, start: int = 0, stop: int | None = None
    ) -> Any:
        if record is MISSING:
            if self.cache is not None:
                t0 = time.perf_counter()
                record = self.cache.get(index)
                if record is not MISSING:
                    tick(timer, "cache hit", t0)
                    start = self.cache_at
            if record is MISSING and self._combined is not None:
                record = self._combined.read(epoch, index, timer)
            elif record is MISSING:
                t0 = time.perf_counter()
                record = self.source[index]
                tick(timer, "read", t0)
        computed = start == 0
        for k in range(start, len(self.maps) if stop is None else stop):
            if k == self.cache_at and self.cache is not None:
                if computed:
                    self.cache.put(index, record)
                _slots.open_rows()  # what the maps make from here on is never cached
            record = self._apply(self.maps[k], record, epoch, index, k, timer)
        if self.cache is not None and computed and self.cache_at == (len(self.maps) if stop is None else stop):
            self.cache.put(index, record)
        return record

    def _records(self, epoch: int, index: int, record: Any, timer: Timer, start: int) -> list[Any]:
        """The records sample `index` makes through the maps of a chain that expands: the maps
        up to the first filter or flat_map as `_sample`, then over the list it makes."""
        first = next((k for k, m in enumerate(self.maps) if m.expands), len(self.maps))
        if start <= first:
            record = self._sample(epoch, index, record, timer, start, stop=first)
            start = first
        values: list[tuple[tuple[int, ...], Any]] = [((), record)]  # (record numbers, value)
        for k in range(start, len(self.maps)):
            op, made = self.maps[k], list[tuple[tuple[int, ...], Any]]()
            for sub, value in values:
                out = self._apply(op, value, epoch, index, k, timer, sub=sub)
                if op.expands:
                    made.extend(((*sub, j), v) for j, v in enumerate(out))
                else:
                    made.append((sub, out))
            values = made
        return [v for _, v in values]

    def _apply(
        self,
        op: RecordOp,
        value: Any,
        epoch: int,
        index: int,
        k: int,
        timer: Timer,
        batch_level: bool = False,
        sub: tuple[int, ...] = (),
    ) -> Any:
        t0 = time.perf_counter()
        try:
            value = op.apply(value, self.seed, epoch, index, k, *sub)
        except (GlobalLoaderError, ImportError, MemoryError):
            raise  # a named error already, or the environment's fault: never a bad sample
        except Exception as exc:
            what = f"batch {index}" if batch_level else f"sample {_record_key(value, index)}"
            raise TransformError(f"map {op.name!r} failed on {what}: {type(exc).__name__}: {exc}") from exc
        tick(timer, op.name, t0)
        return value


def tick(timer: Timer, stage: str, t0: float, items: int = 1) -> None:
    """Count `items` of `stage` and the time since `t0` in `timer`."""
    entry = timer.get(stage)
    if entry is None:
        timer[stage] = entry = [0, 0.0]
    entry[0] += items
    entry[1] += time.perf_counter() - t0
