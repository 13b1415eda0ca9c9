"""ShufflingDataset: one trainer's view of a global per-epoch shuffle on a Ray cluster."""

from __future__ import annotations

import contextlib
import hashlib
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import ray
import ray.exceptions as rex
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from globalloader._seeding import check_seed
from globalloader.errors import ArgumentError, ArgumentTypeError, StateError, WorkerError, check_int
from globalloader.ray.layout import default_num_reducers
from globalloader.ray.prefetch import OutputPrefetcher, ask_queue, task_error
from globalloader.ray.queue import BatchQueue, ShuffleSpec
from globalloader.ray.reader import parts_of

_NAME_TAKEN = getattr(rex, "ActorAlreadyExistsError", ValueError)
NAMESPACE = "globalloader"  # queues are found by name from any driver or actor in the cluster
_ATTACH_POLL_S = 0.2
_TAKE_POLL_S = 5.0
RPC_GRACE_S = 60.0  # beyond its own wait, how long a call to the batch queue may take


class ShufflingDataset(contextlib.AbstractContextManager["ShufflingDataset"]):
    """Globally shuffled batches for one data-parallel trainer, a new order every epoch.

    Every rank constructs one with the same arguments and its own `rank`. Rank 0 plans the
    shuffle and starts a named Ray actor (the batch queue) that the other ranks find by name;
    per epoch, map tasks read the parts of `data` (a `gl.Dataset` whose per-record operators,
    maps, filters and flat_maps, they run as the Loader does; a source; or files with
    `storage_options=`; see `reader`) and scatter rows to `num_reducers` reducers by a
    seeded random assignment, reducers permute and cut batches, and each trainer fetches its
    batches from the object store, `prefetch` reducer outputs ahead, at most
    `max_concurrent_epochs` epochs alive at once (memory).

        for epoch in range(num_epochs):
            ds.set_epoch(epoch)          # optional: iterating again moves to the next epoch
            for batch in ds: ...         # {column: np.ndarray}, rows along axis 0

    Batches are read-only views of Ray's shared memory. With drop_last=False every row appears once
    per epoch across all trainers (each trainer's last batch shares the leftover rows); with
    drop_last=True every batch is full. Every trainer gets `len(ds)` batches every epoch
    (`len(iter(ds))` after a filter or flat_map: it changes by epoch; DDP never hangs), in an order
    fixed by the data, `seed`, `num_trainers`, `batch_size`, `num_reducers` and `drop_last` alone.
    Rank 0's process ends the batch queue: it must not exit before the others finish. A rank
    restarted from its `state_dict()` rejoins the running shuffle; a lost queue, or a wait beyond
    `timeout` seconds, is a WorkerError saying why; an unreadable file a SourceError naming it.
    `name`: the shuffle's name in the cluster (default: from the arguments). `epoch_stats`: where
    time went per epoch, and reducer outputs (and bytes) pulled from another node. docs/ray.md says
    more.
    """

    def __init__(
        self,
        data: Any,
        num_epochs: int,
        num_trainers: int,
        batch_size: int,
        rank: int,
        num_reducers: int | None = None,
        max_concurrent_epochs: int = 2,
        seed: int = 0,
        drop_last: bool = False,
        *,
        columns: Sequence[str] | None = None,
        prefetch: int = 2,
        timeout: float | None = 600.0,
        name: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        for arg, value in (
            ("num_epochs", num_epochs),
            ("num_trainers", num_trainers),
            ("batch_size", batch_size),
            ("max_concurrent_epochs", max_concurrent_epochs),
            ("prefetch", prefetch),
        ):
            check_int(value, arg, 1)
        check_int(rank, "rank")
        check_seed(seed, "seed")
        if rank >= num_trainers:
            raise ArgumentError(f"rank must be in 0..{num_trainers - 1}, got {rank}")
        if columns is not None and (
            isinstance(columns, str) or not columns or not all(isinstance(c, str) for c in columns)
        ):
            raise ArgumentError(f"columns must be a non-empty list of str or None, got {columns!r}")
        parts = parts_of(data, columns, storage_options)
        if num_reducers is None:
            num_reducers = default_num_reducers(len(parts), num_trainers)
        check_int(num_reducers, "num_reducers", num_trainers)
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ArgumentError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        self.spec = ShuffleSpec(
            tuple(parts),
            tuple(columns) if columns is not None else None,
            num_epochs,
            num_trainers,
            batch_size,
            num_reducers,
            max_concurrent_epochs,
            seed,
            bool(drop_last),
        )
        self.rank = rank
        self.name = name or "globalloader-shuffle-" + hashlib.sha1(self.spec.key.encode()).hexdigest()[:16]
        self._prefetch = prefetch
        self._timeout = timeout
        if not ray.is_initialized():
            ray.init()
        self._node = ray.get_runtime_context().get_node_id()
        self._presence = ray.put(rank)  # owned by this process: the queue sees when it dies
        self._queue, info = self._create() if rank == 0 else self._attach()
        self._batches: int | None = info["batches"]  # per trainer and epoch; None: known per epoch only
        self.total_rows: int | None = info["rows"]
        self._epoch: int | None = None  # set by set_epoch / load_state_dict for the next iter
        self._next_epoch = 0
        self._skip = 0  # batches of the next epoch already consumed (after load_state_dict)
        self._active: _EpochIterator | None = None
        self.epoch_stats: dict[int, dict[str, float]] = {}

    def _create(self) -> tuple[Any, dict[str, Any]]:
        """Rank 0: count rows, check the plan, and start the queue (replacing a finished one)."""
        if not self.spec.expands:
            self.spec.layout(np.array([part.rows for part in self.spec.files]))  # ArgumentError here, not remote
        deadline = time.monotonic() + 10.0
        while True:
            try:
                # mypy does not apply class decorators: @ray.remote made BatchQueue an ActorClass.
                queue = BatchQueue.options(  # type: ignore[attr-defined]
                    name=self.name,
                    namespace=NAMESPACE,
                    # Hard: its node is alive (this process runs there) and needs no CPU; Ray places
                    # an actor elsewhere now and then under soft affinity, tying the job to that node.
                    scheduling_strategy=NodeAffinitySchedulingStrategy(self._node, soft=False),
                )
                handle = queue.remote(self.spec)
                break
            except ValueError as exc:
                if "taken" not in str(exc) and not isinstance(exc, _NAME_TAKEN):
                    raise
                if not self._replace_finished() and time.monotonic() > deadline:
                    raise ArgumentError(
                        f"a shuffle named {self.name!r} is already running in this Ray "
                        "cluster: close() it, or pass a distinct name="
                    ) from None
                time.sleep(_ATTACH_POLL_S)
        info = ray.get(handle.attach.remote(0, self.spec.key, self._node, [self._presence]))
        return handle, info

    def _replace_finished(self) -> bool:
        """Kill a same-named queue whose job has finished; True if there is none any more."""
        try:
            old = ray.get_actor(self.name, namespace=NAMESPACE)
            if not ray.get(old.finished.remote(), timeout=10):
                return False
            ray.kill(old)
        except (ValueError, rex.RayActorError, rex.GetTimeoutError):
            pass
        return True

    def _attach(self) -> tuple[Any, dict[str, Any]]:
        """Other ranks: find rank 0's queue by name and check it runs the same shuffle."""
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        why = "rank 0 has not created it"
        while deadline is None or time.monotonic() < deadline:
            try:
                # Any: Ray resolves actor methods at run time and types them as Never.
                handle: Any = ray.get_actor(self.name, namespace=NAMESPACE)
                info = ray.get(handle.attach.remote(self.rank, self.spec.key, self._node, [self._presence]))
            except (ValueError, rex.RayActorError):
                time.sleep(_ATTACH_POLL_S)
                continue
            if "error" not in info:
                return handle, info
            if info["error"] == "mismatch":
                raise ArgumentError(
                    f"rank {self.rank}'s arguments differ from rank 0's for shuffle "
                    f"{self.name!r}: {self.spec.key} vs {info['spec']}"
                )
            why = (
                f"rank {self.rank} is already attached to it by a live process (two trainers with one "
                "rank, or an earlier job with the same arguments still holds the name)"
            )
            time.sleep(_ATTACH_POLL_S)
        raise WorkerError(f"rank {self.rank} could not join shuffle {self.name!r} within {self._timeout:.0f} s: {why}")

    def __len__(self) -> int:
        """Batches every trainer gets per epoch; a chain with a filter or flat_map has no length
        before it runs (ArgumentTypeError): `len(iter(ds))` is the epoch's, once it is cut."""
        if self._batches is None:
            raise ArgumentTypeError(
                f"shuffle {self.name!r} runs a filter or flat_map: its batches per epoch are known only once "
                "the epoch's map tasks ran; len(iter(ds)) is the current epoch's"
            )
        return self._batches

    @property
    def num_epochs(self) -> int:
        return self.spec.num_epochs

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next iteration reads (epochs go forward only)."""
        check_int(epoch, "epoch")
        if epoch >= self.spec.num_epochs:
            raise ArgumentError(f"epoch must be in 0..{self.spec.num_epochs - 1}, got {epoch}")
        if epoch != self._epoch:
            self._skip = 0
        self._epoch = epoch

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        epoch = self._epoch if self._epoch is not None else self._next_epoch
        if epoch >= self.spec.num_epochs:
            raise StateError(f"all {self.spec.num_epochs} epochs of shuffle {self.name!r} were read")
        if self._active is not None:
            self._active.close()
        started = time.perf_counter()
        batches = self._take(epoch)
        self._active = _EpochIterator(self, epoch, self._skip, started, batches)
        self._epoch, self._skip, self._next_epoch = None, 0, epoch + 1
        return self._active

    def _take(self, epoch: int) -> dict[str, Any]:
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        ticket = uuid.uuid4().hex
        return ask_queue(
            lambda wait: ray.get(self._queue.take.remote(self.rank, epoch, wait, ticket), timeout=wait + RPC_GRACE_S),
            _TAKE_POLL_S,
            deadline,
            f"rank {self.rank} cannot take epoch {epoch} of shuffle {self.name!r}",
            lambda why: (
                f"rank {self.rank} waited {self._timeout:.0f} s for epoch {epoch} of shuffle {self.name!r}: "
                f"{why} (a trainer may have died or stalled; at most {self.spec.max_concurrent_epochs} epochs are "
                "shuffled ahead)"
            ),
        )

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the epoch and how many of its batches were consumed."""
        if self._active is not None and not self._active.finished:
            return {"shuffle": self.spec.key, "epoch": self._active.epoch, "batches": self._active.position}
        epoch = self._epoch if self._epoch is not None else self._next_epoch
        return {"shuffle": self.spec.key, "epoch": epoch, "batches": self._skip}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`: the next iteration reads its epoch from its batch on.

        The epoch's shuffle is recomputed (same seed, same batches); batches before the
        position are skipped, whole reducer outputs without being fetched.
        """
        if not isinstance(state, dict) or set(state) != {"shuffle", "epoch", "batches"}:
            raise StateError(f"not a ShufflingDataset state: {state!r}")
        if state["shuffle"] != self.spec.key:
            raise StateError(f"the state belongs to another shuffle: {state['shuffle']}")
        if state["batches"] < 0 or (self._batches is not None and state["batches"] > self._batches):
            raise StateError(f"state batches {state['batches']} is outside 0..{self._batches}")
        if state["epoch"] < self.spec.num_epochs:
            self.set_epoch(state["epoch"])
        else:
            self._epoch = None
        self._next_epoch = state["epoch"]
        self._skip = state["batches"]

    def close(self) -> None:
        """Stop prefetching; on rank 0 also stop the batch queue (the others can no longer read)."""
        if self._active is not None:
            self._active.close()
            self._active = None
        if self.rank == 0 and self._queue is not None:
            ray.kill(self._queue)
            self._queue = None

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.name!r}, rank {self.rank}/{self.spec.num_trainers}, "
            f"{len(self.spec.files)} parts, {self.total_rows} rows, {self._batches} batches of "
            f"{self.spec.batch_size} per epoch)"
        )


class _EpochIterator:
    """One rank's batches of one epoch: slices of reducer outputs fetched in order."""

    def __init__(self, owner: ShufflingDataset, epoch: int, skip: int, started: float, batches: dict[str, Any]) -> None:
        """`batches`: the rank's batch sizes this epoch and the batches each of its reducers makes."""
        if "failed" in batches:
            raise task_error(batches["failed"], f"epoch {epoch} of shuffle {owner.name!r}")
        self._owner = owner
        self.epoch = epoch
        self.position = skip  # batches consumed so far
        self.finished = False
        self._sizes = np.asarray(batches["batch_sizes"])
        self._row_start = np.concatenate([[0], np.cumsum(self._sizes)])
        runs = np.asarray(batches["reducer_batches"])
        first = int(np.searchsorted(runs[:, 1], skip, side="right")) if len(runs) else 0
        self._runs = runs[first:]
        self._next_run = 0
        self._run_stop = skip  # the current output covers batches up to here
        self._current: dict[str, np.ndarray] = {}
        self._base = 0  # row of the epoch where the current output starts
        self._started = started
        queue, rank = owner._queue, owner.rank
        self._fetcher = OutputPrefetcher(
            len(runs) - first,
            lambda i, wait: ray.get(queue.output.remote(rank, epoch, first + i, wait), timeout=wait + RPC_GRACE_S),
            owner._prefetch,
            owner._timeout,
            lambda i: f"rank {rank}'s output {first + i} of epoch {epoch}",
            owner._node,
        )

    def __iter__(self) -> _EpochIterator:
        return self

    def __len__(self) -> int:
        """Batches this rank gets this epoch (those already consumed too)."""
        return len(self._sizes)

    def __next__(self) -> dict[str, np.ndarray]:
        if self.position >= len(self._sizes):
            self._finish()
            raise StopIteration
        if self.position >= self._run_stop:
            self._current = self._fetcher.next()
            start, self._run_stop = (int(x) for x in self._runs[self._next_run])
            self._base = int(self._row_start[start])
            self._next_run += 1
        a = int(self._row_start[self.position]) - self._base
        b = a + int(self._sizes[self.position])
        batch = {name: column[a:b] for name, column in self._current.items()}
        if self.epoch not in self._owner.epoch_stats:
            self._owner.epoch_stats[self.epoch] = {"first_batch_s": time.perf_counter() - self._started}
        self.position += 1
        return batch

    def _finish(self) -> None:
        if not self.finished:
            self.finished = True
            stats = self._owner.epoch_stats.setdefault(self.epoch, {})
            stats["wait_s"] = self._fetcher.wait_s
            stats["pulled_outputs"] = self._fetcher.pulled
            stats["pulled_bytes"] = self._fetcher.pulled_bytes
            stats["epoch_s"] = time.perf_counter() - self._started
            self.close()
            self._owner._queue.done.remote(self._owner.rank, self.epoch)  # fire and forget: frees memory sooner

    def close(self) -> None:
        self._fetcher.close()
        self._current = {}
