"""The server's decode workers: read and run a group's shared prefix, write into the arena.

A load is a short conversation on the worker's pipe: the server sends `load` (or `loads`, a
group of them in one message); the worker runs the prefix (source read + shared maps), writes the
sample into the offset reserved ahead when it fits, else asks the server to `reserve` the bytes it
needs and waits for `at` (the store may first evict, or wait for releases), then reports `done`
with its layout, or `failed` with the name of the error class and a message (a group's outcomes
go back together as `replies`, within HOLD_S of each being done). Each worker keeps the prefixes
it has been sent, so a chain is unpickled once per worker, not once per sample.

Faults of the machinery are not faults of a sample: a worker that dies (a signal, an OOM kill)
is replaced and its loads are given to another worker; only a load that kills `MAX_ATTEMPTS`
workers fails, as a WorkerError. A load that runs past its deadline (the waiting jobs'
`Loader(timeout=)`) has its worker killed and fails as a LoaderTimeoutError; the worker's other
loads are retried. Only an exception raised by the chain itself is reported as a sample error.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

from globalloader.errors import (
    UNPICKLABLE,
    GlobalLoaderError,
    SampleTooLargeError,
    SharedPrefixError,
    SourceError,
    WorkerError,
    unsendable,
)
from globalloader.runtime.pool import Worker, WorkerPool
from globalloader.service.protocol import STALL_S, error_name
from globalloader.service.sample_store import SampleStore
from globalloader.sources.base import Prefetching
from globalloader.transport import arena

MAX_ATTEMPTS = 3  # workers a load may kill before it fails
# In flight per worker: two groups of GROUP loads, one running and one queued, so that no worker
# idles between groups. A group is one message each way (the loads, then their outcomes): half
# the messages, wake-ups and context switches of one load per message, for one decode of delay
# on the first sample of a group.
LOADS_PER_WORKER = 4
GROUP = 2
HOLD_S = 0.05  # the longest a finished load's outcome waits for the rest of its group
Key = tuple[str, int]  # (prefix fingerprint, index)


def _run_prefix(prefix: Any, index: int) -> Any:
    """The shared prefix's sample, with a failure named as the job will see it."""
    try:
        return prefix.prefix_sample(index)
    except (GlobalLoaderError, MemoryError):
        raise
    except ImportError as exc:  # a module the shared maps need is not importable here
        raise SharedPrefixError(f"the server cannot import what the shared maps need: {exc}") from exc
    except Exception as exc:  # raised by the source's own read, not by a map
        raise SourceError(f"reading sample {index} failed: {type(exc).__name__}: {exc}") from exc


def _prefetch(prefix: Any, indices: Any) -> None:
    """Have a remote source download the objects of these samples into the machine cache in the
    background (threads of this worker; see `Prefetching`), so that the loads find them there.
    A prefetch that fails is no error: the load that needs the object fetches it and reports."""
    source = None if prefix is None or isinstance(prefix, str) else prefix.source
    if isinstance(source, Prefetching) and source.remote:
        with contextlib.suppress(GlobalLoaderError, OSError):
            source.prefetch(indices)


class DecodeBody:
    """A decode worker's body (`runtime.WorkerPool`): the shared prefixes it was sent, and loads."""

    def __init__(self, arena_id: arena.ArenaId, running: Any) -> None:
        self.arena_id = arena_id
        # Per worker slot, the order number of the load it started last (shared memory, written
        # here, read by the server): which load of a group runs, whatever outcomes are held.
        self.running = running

    def setup(self, worker: Worker) -> None:
        self.memory = arena.attach(self.arena_id)
        self.prefixes: dict[str, Any] = {}
        self.backlog: deque[tuple] = deque()  # messages that arrived while waiting for an offset
        self.replies: list[tuple] = []  # outcomes of the loads of this message, sent together
        self.held_since = 0.0  # when the oldest of them was finished
        self.lock = threading.Lock()  # over replies and every send: a thread sends late ones
        threading.Thread(target=self._send_held, args=(worker,), daemon=True, name="globalloader-replies").start()

    def run(self, worker: Worker, msg: tuple) -> None:
        self._handle(worker, msg)
        while self.backlog:
            self._handle(worker, self.backlog.popleft())
        self._reply(worker)

    def _send_held(self, conn: Worker) -> None:
        """Outcomes held longer than HOLD_S go out without the rest of their group: a load that
        runs long (or hangs) keeps nothing else from its job."""
        while True:
            time.sleep(HOLD_S)
            if self.replies and time.monotonic() - self.held_since > HOLD_S:
                try:
                    self._reply(conn)
                except (OSError, ValueError):  # the server closed the pipe: this worker is ending
                    return

    def _done(self, reply: tuple) -> None:
        with self.lock:
            if not self.replies:
                self.held_since = time.monotonic()
            self.replies.append(reply)

    def _reply(self, conn: Worker) -> None:
        """Send the outcomes gathered so far: one message for a group of loads."""
        with self.lock:
            replies, self.replies = self.replies, []
            if not replies:
                return
            try:
                conn.send(replies[0] if len(replies) == 1 else ("replies", replies))
            except UNPICKLABLE:  # a sample's layout holds a value pickle refuses: that load failed
                replies = [self._sendable(reply) for reply in replies]
                conn.send(replies[0] if len(replies) == 1 else ("replies", replies))

    def _sendable(self, reply: tuple) -> tuple:
        """`reply`, or the failure of its load if it cannot be pickled, naming the map that made it."""
        try:
            pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except UNPICKLABLE as exc:
            _, fp, index, *_ = reply
            prefix = self.prefixes[fp]
            made_by = f"map {prefix.maps[prefix.split - 1].name!r}" if prefix.split else "the source"
            message = unsendable(
                f"{made_by} returned, for sample index {index}, a value the server's decode worker cannot send", exc
            )
            return ("failed", fp, index, "TransformError", message)
        return reply

    def _handle(self, conn: Worker, msg: tuple) -> None:
        if msg[0] == "loads":
            for load in msg[1]:
                self._handle(conn, ("load", *load))
            return
        prefixes, memory, backlog = self.prefixes, self.memory, self.backlog
        if msg[0] == "prefetch":
            _prefetch(prefixes.get(msg[1]), msg[2])
            return
        if msg[0] == "prefix":
            try:
                prefixes[msg[1]] = pickle.loads(msg[2])
            except Exception as exc:  # noqa: BLE001 - unpickling runs the job's code; every load of it then fails with this
                prefixes[msg[1]] = (
                    f"the server cannot load this job's shared prefix ({type(exc).__name__}: {exc}); "
                    "the server must be able to import every module the shared maps use"
                )
            return
        _, fp, index, guess, order = msg  # guess: (offset, bytes) reserved ahead, or None
        self.running[conn.index] = order
        t0 = time.perf_counter()
        prefix = prefixes[fp]
        if isinstance(prefix, str):
            self._done(("failed", fp, index, "SharedPrefixError", prefix))
            return
        try:
            sample = _run_prefix(prefix, index)
            layout, placed = arena.encode(sample)
        except Exception as exc:  # noqa: BLE001 - whatever the user's maps raise is that sample's failure, sent back
            self._done(("failed", fp, index, error_name(exc), str(exc)))
            return
        if guess is not None and layout[0] <= guess[1]:
            offset = guess[0]  # the usual case: no round trip to the server
        else:
            self._reply(conn)  # what is done goes first: the server may need it to make room
            with self.lock:
                conn.send(("reserve", fp, index, layout[0]))
            while (reply := conn.receive())[0] not in ("at", "abort"):
                backlog.append(reply)
            if reply[0] == "abort":
                self._done(("failed", fp, index, reply[1], reply[2]))
                return
            offset = reply[1]
        memory.write(offset, placed)
        self._done(("done", fp, index, layout, time.perf_counter() - t0))


@dataclass
class Load:
    key: Key
    deadline: float  # monotonic time by which it must be done
    timeout: float
    attempts: int = 0
    order: int = 0  # when it was sent, over all workers: earlier loads are placed first


@dataclass
class _Worker:
    slot: int  # its place in the WorkerPool
    prefixes: set[str] = field(default_factory=set)
    loads: dict[Key, Load] = field(default_factory=dict)  # in flight
    unsent: list[tuple[str, int, Any, int]] = field(default_factory=list)  # loads for `send`: (fp, index, guess, order)
    # When it last answered a load: the oldest load in flight started running no earlier (a load
    # queued behind another job's long one must not be timed while it waits, nor blamed for it).
    answered: float = field(default_factory=time.monotonic)


class Events(Protocol):
    """What the decoders tell their server."""

    store: SampleStore

    def prefix_of(self, fp: str) -> bytes | None: ...
    def loaded(self, fp: str, index: int, layout: Any) -> None: ...
    def failed(self, fp: str, index: int, error: str, message: str) -> None: ...


class Decoders:
    """Starts, feeds and watches the decode workers of a server."""

    def __init__(
        self,
        size: int,
        arena_id: arena.ArenaId,
        events: Events,
        register: Callable[[Connection, Callable[[], None]], None],
        unregister: Callable[[Connection], None],
    ) -> None:
        self.size, self._events = size, events
        self.store = events.store
        self._register, self._unregister = register, unregister
        self._waiting_space: deque[tuple[_Worker, str, int, int]] = deque()
        self._space_progress = time.monotonic()  # last time arena space was granted or released
        self._sizes: dict[str, int] = {}  # largest sample each prefix produced: the next guess
        self._sent = 0  # loads sent so far (their order)
        # Every load in flight by key, beside its worker's own `loads` (`_start` and `_end` keep both).
        self._loading: dict[Key, _Worker] = {}
        self.decode_s = 0.0
        self.restarts = 0
        self.space_requests = 0  # loads whose worker had to ask for space (a round trip while it waits)
        context = mp.get_context("fork")
        self._running = context.RawArray("q", size)  # see DecodeBody.running
        self._processes = WorkerPool(DecodeBody(arena_id, self._running), size, context, 0, name="decode worker")
        self._workers = [self._watch(slot) for slot in range(size)]

    def _watch(self, slot: int) -> _Worker:
        worker = _Worker(slot)
        self._register(self._processes.conns[slot], lambda: self._message(worker))
        return worker

    def room(self) -> bool:
        """Whether the server should draw more samples now: while fewer than LOADS_PER_WORKER
        loads per worker are in flight, or while a load waits for arena space (then only what jobs
        draw can complete their batches, and so release space)."""
        return len(self._loading) < LOADS_PER_WORKER * self.size or bool(self._waiting_space)

    def _place_in_flight(self) -> bool:
        """Whether every load in flight has its space reserved in the arena, after reserving it,
        oldest first, for the loads sent without (their size was not known yet, or an earlier
        one had none): their workers then get the offset at once when they ask. Without this, one
        load sent without space makes every later one go without too, while it is in flight: with
        a worker's queue always full, each load would cost its worker a round trip to the server."""
        if self._waiting_space:
            return False
        store = self.store
        unplaced = [key for key in self._loading if key not in store]
        if not unplaced:
            return True
        loads = sorted((self._loading[key].loads[key] for key in unplaced), key=lambda load: load.order)
        for load in loads:
            size = self._sizes.get(load.key[0])
            if size is None or size > self.store.capacity or self.store.reserve(load.key, size) is None:
                return False
        return True

    def load(self, fp: str, index: int, timeout: float, attempts: int = 0) -> None:
        """Start loading sample `index` of prefix `fp`; `timeout` bounds how long it may run."""
        prefix = self._events.prefix_of(fp)
        if prefix is None or (fp, index) in self._loading:  # its jobs left; or it is on its way
            return
        worker = min(self._workers, key=lambda w: len(w.loads))
        # Reserve the largest size this chain produced so far, so the worker can write without
        # asking; a bigger sample falls back to asking (the guess is given back first). Not
        # while an earlier load has no space yet: jobs take samples in the order they were drawn,
        # and a later one holding the space an earlier one waits for could stall them all.
        size = self._sizes.get(fp)
        offset = None
        if size is not None and size <= self.store.capacity and self._place_in_flight():
            offset = self.store.reserve((fp, index), size)
        self._sent += 1
        self._start(worker, Load((fp, index), time.monotonic() + timeout, timeout, attempts, self._sent))
        if fp not in worker.prefixes:  # after the loads queued before it, in order
            if not (self._send(worker) and self._tell(worker, ("prefix", fp, prefix))):
                return  # it died since we last looked: its replacement takes this load too
            worker.prefixes.add(fp)
        worker.unsent.append((fp, index, None if offset is None else (offset, size), self._sent))

    def send(self) -> None:
        """Send the loads started since the last call, one message per worker: the server calls
        it once per round of events, so a worker that finished two loads gets its next two in one
        message (and answers them in one)."""
        for worker in list(self._workers):
            if worker.unsent:
                self._send(worker)

    def _send(self, worker: _Worker) -> bool:
        unsent, worker.unsent = worker.unsent, []
        for k in range(0, len(unsent), GROUP):
            group = unsent[k : k + GROUP]
            if not self._tell(worker, ("load", *group[0]) if len(group) == 1 else ("loads", group)):
                return False
        return True

    def _start(self, worker: _Worker, load: Load) -> None:
        worker.loads[load.key] = load
        self._loading[load.key] = worker

    def _end(self, worker: _Worker, key: Key) -> None:
        if worker.loads.pop(key, None) is not None:
            del self._loading[key]

    def prefetch(self, fp: str, indices: Any) -> None:
        """Tell a worker the samples a pass will read: a remote source downloads their objects
        ahead into the machine cache (the joint sampler's order is not known in advance, and
        touches most of them early; the cache and its prefetch depth bound what is kept)."""
        prefix = self._events.prefix_of(fp)
        if prefix is None:
            return
        worker = min(self._workers, key=lambda w: len(w.loads))
        if fp not in worker.prefixes:  # a worker that died meanwhile is replaced: the loads fetch themselves
            if not self._tell(worker, ("prefix", fp, prefix)):
                return
            worker.prefixes.add(fp)
        self._tell(worker, ("prefetch", fp, indices))

    def _message(self, worker: _Worker) -> None:
        try:
            msg = self._processes.read(worker.slot)  # the server's selector saw its pipe readable
        except WorkerError:
            self._replace(worker)
            return
        try:
            for reply in msg[1] if msg[0] == "replies" else (msg,):
                if worker in self._workers:
                    self._handle(worker, reply)
        except Exception:  # a bug here must not leave the worker waiting for an answer forever
            self._replace(worker, "was restarted after a server error (see the log)")
            raise

    def _handle(self, worker: _Worker, msg: tuple) -> None:
        kind, fp, index = msg[:3]
        key = (fp, index)
        if kind == "reserve":
            self.space_requests += 1
            self._sizes[fp] = max(self._sizes.get(fp, 0), msg[3])
            entry = self.store.get(key)
            if entry is not None and not entry.ready and entry.nbytes >= msg[3]:  # reserved since it was sent
                self._space_progress = time.monotonic()
                self._tell(worker, ("at", entry.offset))
                return
            self._abort_reservation(key)  # the guess was too small
            self._reserve(worker, fp, index, msg[3])
            return
        self._end(worker, key)
        worker.answered = time.monotonic()
        if kind == "done":
            self.decode_s += msg[4]
            self._sizes[fp] = max(self._sizes.get(fp, 0), msg[3][0])
            self.store.shrink(key, msg[3][0])
            self._events.loaded(fp, index, msg[3])
        else:
            self._abort_reservation(key)
            self._events.failed(fp, index, msg[3], f"sample {index}: {msg[4]}")

    def _abort_reservation(self, key: Key) -> None:
        entry = self.store.get(key)
        if entry is not None and not entry.ready:
            self.store.abort(key)

    def _reserve(self, worker: _Worker, fp: str, index: int, nbytes: int) -> None:
        try:
            offset = self.store.reserve((fp, index), nbytes)
        except SampleTooLargeError as exc:
            self._tell(worker, ("abort", "SampleTooLargeError", str(exc)))
            return
        if offset is None:
            self._waiting_space.append((worker, fp, index, nbytes))
        else:
            self._space_progress = time.monotonic()
            self._tell(worker, ("at", offset))

    def retry_reservations(self) -> None:
        """Space was released: hand it to the loads waiting for it, oldest first."""
        self._space_progress = time.monotonic()
        while self._waiting_space:
            worker, fp, index, nbytes = self._waiting_space[0]
            offset = self.store.reserve((fp, index), nbytes)
            if offset is None:
                return
            self._waiting_space.popleft()
            self._tell(worker, ("at", offset))

    def check(self) -> None:
        """Called often by the server: dead workers, loads past their deadline, a stalled arena."""
        now = time.monotonic()
        for worker in list(self._workers):
            why = self._processes.exited(worker.slot)
            if why is not None:
                self._replace(worker, why)
                continue
            # The oldest load is timed: a worker takes its loads in order. Its time runs from when
            # it was sent or from the worker's last answer, whichever is later: the loads queued
            # behind it wait without being timed (their job's timeout may be shorter than the
            # running load's), and are loaded again elsewhere when it is late.
            load = min(worker.loads.values(), key=lambda load: load.order, default=None)
            if load is not None and now > max(load.deadline, worker.answered + load.timeout):
                # The one to blame is the one it runs: a finished load's outcome may still be held
                # for its group, behind one that hangs (keeping the GIL, even the worker's sending
                # thread cannot run).
                load = self._started(worker) or load
                self._processes.kill(worker.slot)  # before its space is given back: it must not write there
                self._end(worker, load.key)
                self._abort_reservation(load.key)
                fp, index = load.key
                message = (
                    f"sample {index}: the shared prefix ran for more than {load.timeout:.0f} s on it "
                    "(Loader(timeout=)); its decode worker was restarted"
                )
                self._events.failed(fp, index, "LoaderTimeoutError", message)
                self._replace(worker, "was killed after a load passed its deadline", blamed=True)
        if self._waiting_space and now - self._space_progress > STALL_S:
            self._fail_stalled()

    def _fail_stalled(self) -> None:
        """Nothing was released for STALL_S while a load waits for room: every job holds what it
        has and waits for more, which no release will ever bring. Fail that load loudly."""
        worker, _fp, index, nbytes = self._waiting_space.popleft()
        message = (
            f"the server's memory pool is too small: its {self.store.capacity:,} bytes are all held by the jobs' "
            f"batches in progress and sample {index} ({nbytes:,} bytes) found no room for {STALL_S:.0f} s; start the "
            "server with more --memory (at least batch size x sample bytes x jobs, times prefetch + 1)"
        )
        self._tell(worker, ("abort", "PoolTooSmallError", message))
        self._space_progress = time.monotonic()

    def _tell(self, worker: _Worker, msg: tuple) -> bool:
        """Send a worker `msg`; False if it died meanwhile, and was replaced (its loads retried)."""
        try:
            self._processes.send(worker.slot, msg)
        except WorkerError:
            self._replace(worker)
            return False
        return True

    def _started(self, worker: _Worker) -> Load | None:
        """The load `worker` started last, from its mark in shared memory, if still in flight."""
        started = self._running[worker.slot]
        return next((load for load in worker.loads.values() if load.order == started), None)

    def _replace(self, worker: _Worker, why: str | None = None, blamed: bool = False) -> None:
        """A decode worker died: start another and give it the dead one's loads again. Only the
        load it was running counts an attempt (the others waited behind it), unless `blamed`
        (that one has already failed) or it is not known (then every one counts)."""
        if worker not in self._workers:
            return
        why = why or self._processes.exited(worker.slot) or "closed its pipe"
        running = None if blamed else self._started(worker)
        self._workers.remove(worker)
        self._unregister(self._processes.conns[worker.slot])
        self._processes.restart(worker.slot)
        self.restarts += 1
        self._waiting_space = deque(w for w in self._waiting_space if w[0] is not worker)
        self._workers.append(self._watch(worker.slot))
        worker.unsent.clear()
        for load in list(worker.loads.values()):
            self._end(worker, load.key)
            fp, index = load.key
            self._abort_reservation(load.key)
            ran = not blamed and (running is None or load is running)  # it may have killed the worker
            attempts = load.attempts + int(ran)
            if attempts >= MAX_ATTEMPTS:
                message = f"sample {index}: the server's decode worker {why} while loading it, {MAX_ATTEMPTS} times"
                self._events.failed(fp, index, "WorkerError", message + " in a row; see the server log")
            else:
                self.load(fp, index, load.timeout, attempts)

    def close(self) -> None:
        self._processes.close()
        self._workers = []
