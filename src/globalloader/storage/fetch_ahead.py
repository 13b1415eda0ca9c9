"""FetchAhead: many small objects downloaded ahead of the reads, many requests in flight at once.

A folder of raw files (one JPEG per object) is bound by request latency, not bandwidth: at 20 ms
a request, the few downloads a thread pool keeps in flight cap an epoch at a few hundred objects
per second. The loader knows the epoch's order, so the process that announces it (the loader's
own process: one per job, never its workers) runs one pool of coroutines on the storage client's
event loop, each a GET written into the machine cache, up to a limit of requests in flight.

Bounds, all settable (docs/remote.md): requests in flight (`concurrency`,
$GLOBALLOADER_FETCH_CONCURRENCY, default 128 per machine), bytes of answers held in memory at
once (`memory`, $GLOBALLOADER_FETCH_MEMORY, default 256 MB: a GET starts only while they fit, one
at least), requests waiting (`depth`, as many as the loader's horizon names: the newest beyond
are dropped, their readers fetch them), and room in the cache (`room(size, under_way)`: a GET starts only
while the objects fetched and not read yet leave room for it, see `ObjectCache.room_ahead`;
asked again every ROOM_POLL seconds while it has none). Memory stays flat over an epoch: what is fetched goes to disk.

The machine's budget is shared, not multiplied: each pool registers in the cache folder
(`fetchers/`, see `storage.registry`) and takes
`concurrency // live pools`, counted again every `RECOUNT` seconds; a process that dies releases
its lock, so its share returns to the others. Workers of a job never run a pool: they read what
the pool fetched, or fetch one object themselves when they get there before the pool claimed it.
The pool claims (`claim`: the object's download lock) what it queued up to its ceiling of
requests in flight, ahead of the GETs the limit lets start, so a worker waits for those.

Throttling (503 SlowDown, 429) halves the limit at once, at most once per round of requests sent
under it (a burst of refusals to one round is one signal), and each success adds 1/limit (one
request per round): AIMD, as TCP does, so a store that asks for less gets less.

The disk work of the downloads (`disk.run`: the cache write) that may wait (for room, for a HEAD)
or is large runs off the event loop in batches: one task of the loop's executor writes every
answer that arrived meanwhile, in order, so an object costs one queue append, not a thread hop and
a future of its own (a hop per object, with the executor's threads contending for the
interpreter, cost more CPU than the write itself). A small object that fits at once is written on
the loop itself, with no hop at all (`Store._fetch_small`). A refused or
transient fault is tried again after `RetryPolicy.delay`, within the policy's attempts and
deadline; a permanent one (403, 404, a changed object) is never tried again: it is counted and
named in `errors`, and the read that needs the object raises it. Every GET has the policy's
deadline of one try.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import os
import pathlib
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from globalloader.errors import ArgumentError
from globalloader.storage import retry
from globalloader.storage._fs import is_throttling, is_transient
from globalloader.storage.cache import parse_size
from globalloader.storage.prefetch import DEPTH
from globalloader.storage.registry import Registration, live

CONCURRENCY_ENV = "GLOBALLOADER_FETCH_CONCURRENCY"
MEMORY_ENV = "GLOBALLOADER_FETCH_MEMORY"
DEFAULT_CONCURRENCY = 128  # requests in flight per machine
DEFAULT_MEMORY = 256 * 10**6  # bytes of answers in memory at once per machine
FETCHERS = "fetchers"  # the cache folder's sub-folder where pools register
RECOUNT = 1.0  # seconds between counts of the pools sharing the machine's budget
ROOM_POLL = 0.005  # seconds between two asks for room in the cache while there is none
STARTS_PER_TURN = 8  # GETs started per turn of the event loop (see `_pump`)
CLAIMS_PER_TURN = 64  # objects claimed per turn of the event loop (see `_claim_ahead`)
SLOW_START = 32  # the first limit of requests in flight (see `_AIMD`)
EXIT_WAIT = 10.0  # seconds a process ending waits for its GETs in flight (see `FetchAhead.close`)
_ERRORS_KEPT = 64  # the latest permanent failures named in `errors`
# An object asked for: url, bytes, what `fetch` is given with it, tries so far, time of the first.
_Item = tuple[str, int, Any, int, float]


def resolve(value: int | str | None, env: str, default: int, what: str) -> int:
    """An argument, else the environment variable `env`, else `default` (sizes like "256MB")."""
    if value is None:
        value = os.environ.get(env) or default
    size = parse_size(value, what)
    if size < 1:
        raise ArgumentError(f"{what} must be at least 1, got {value!r}")
    return size


class _AIMD:
    """The limit of requests in flight: from SLOW_START, +1 per success (doubled each round) up to
    the ceiling or the first throttling; then halved on throttling once per round, +1 per round
    of successes."""

    def __init__(self, ceiling: int) -> None:
        self.ceiling = ceiling
        self.value = float(min(ceiling, SLOW_START))
        self.starting = True  # until the first throttling
        self.round = 0  # bumped at each halving: requests sent before it do not halve again
        self.lowest = ceiling  # the lowest throttling took it to

    def throttled(self, sent_in_round: int) -> None:
        self.starting = False
        if sent_in_round == self.round:
            self.value = max(1.0, self.value / 2)
            self.round += 1
            self.lowest = min(self.lowest, int(self.value))

    def succeeded(self) -> None:
        self.value = min(float(self.ceiling), self.value + (1.0 if self.starting else 1.0 / self.value))

    def set_ceiling(self, ceiling: int) -> None:
        self.ceiling = ceiling
        self.value = min(self.value, float(ceiling))
        self.lowest = min(self.lowest, int(self.value))


class DiskWork:
    """Calls made off the event loop `loop`, in the order asked, by one task of its executor at a
    time that takes every call queued meanwhile (see the module doc). `run` is called on the
    loop's thread; a call whose awaiting was cancelled before it started is skipped."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[Callable[..., None], tuple[Any, ...], asyncio.Future[None]]]
        self._queue = collections.deque()
        self._draining = False

    def run(self, call: Callable[..., None], *args: Any) -> asyncio.Future[None]:
        """`call(*args)` off the loop; the future is its outcome."""
        done: asyncio.Future[None] = self._loop.create_future()
        with self._lock:
            self._queue.append((call, args, done))
            if self._draining:
                return done
            self._draining = True
        try:
            self._loop.run_in_executor(None, self._drain)
        except RuntimeError as exc:  # the executor is shut down (the interpreter is ending)
            with self._lock:
                waiting, self._draining = list(self._queue), False
                self._queue.clear()
            _settle([(future, exc) for _, _, future in waiting])
        return done

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._draining = False
                    return
                batch = list(self._queue)
                self._queue.clear()
            outcomes: list[tuple[asyncio.Future[None], BaseException | None]] = []
            for call, args, done in batch:
                if done.cancelled():  # its download gave up (deadline): its lock is released
                    continue
                try:
                    call(*args)
                except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                    outcomes.append((done, exc))
                else:
                    outcomes.append((done, None))
            self._loop.call_soon_threadsafe(_settle, outcomes)


def _settle(outcomes: list[tuple[asyncio.Future[None], BaseException | None]]) -> None:
    for done, exc in outcomes:
        if done.cancelled():
            continue
        if exc is None:
            done.set_result(None)
        else:
            done.set_exception(exc)


class FetchAhead:
    """Runs `fetch(url, what)` (a coroutine) for requested URLs on `loop`, each URL once, at most
    `limit` at a time (AIMD under `concurrency`) and `memory` bytes of answers at once; the
    requests waiting are at most `depth`, and start as `room` allows. Thread-safe: `request` is called from any
    thread; counters are read with `counters()`.

    `claim(url, what)`, when given, is called on the loop before the GET, for the objects next in
    the queue up to the ceiling of requests in flight (those the slow start or throttling hold
    back included): it returns what `fetch` is given (the object claimed: its readers wait for
    this pool's GET rather than make their own) and the call that releases the claim once the GET
    is done or dropped, or None when there is nothing to fetch (counted as fetched)."""

    def __init__(
        self,
        fetch: Callable[[str, Any], Awaitable[None]],
        loop: asyncio.AbstractEventLoop,
        *,
        concurrency: int,
        memory: int,
        depth: int = DEPTH,
        policy: retry.RetryPolicy = retry.DEFAULT,
        share: pathlib.Path | None = None,
        room: Callable[[int, int], bool] | None = None,
        claim: Callable[[str, Any], tuple[Any, Callable[[], None]] | None] | None = None,
    ) -> None:
        self._fetch, self._loop, self._policy, self._room = fetch, loop, policy, room
        self._claim = claim
        self._room_poll: asyncio.TimerHandle | None = None
        self.concurrency, self.memory, self.depth = concurrency, memory, depth
        self._share = Registration.of(share) if share is not None else None
        self.disk = DiskWork(loop)  # for `fetch`'s disk work
        self._limit = _AIMD(self._ceiling())
        self._counted_at = time.monotonic()
        self._lock = threading.Lock()
        self._queue: collections.deque[_Item] = collections.deque()
        self._queued_bytes = 0
        # Claimed, waiting for the limit to start their GETs: url, bytes, what, tries, time of the
        # first, what `fetch` is given, the claim's release.
        self._held: collections.deque[tuple[str, int, Any, int, float, Any, Callable[[], None]]]
        self._held = collections.deque()
        self._held_bytes = 0
        # Queued or waiting to be tried again; not in flight: an object asked for again while its
        # GET is under way (a new epoch's) is queued again, and skipped then if it is still cached.
        self._asked: set[str] = set()
        self.in_flight = self.in_flight_bytes = 0
        self.peak_in_flight = self.peak_memory = 0
        self.fetched = self.bytes = self.throttled = self.retried = self.failed = self.dropped = 0
        self.skipped = 0  # of the fetched, those with nothing to fetch (see `claim`)
        self.errors: collections.deque[str] = collections.deque(maxlen=_ERRORS_KEPT)
        self._closed, self._pid = False, os.getpid()
        atexit.register(_close_at_exit, weakref.ref(self))

    def close(self, timeout: float = EXIT_WAIT) -> None:
        """Start no more GETs (what waits is dropped) and wait, `timeout` seconds at most, for those
        in flight: a GET's answer arriving from obstore's runtime into an interpreter that is
        finalizing crashes the process (SIGSEGV at exit). Only in the process that made the pool."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            self._closed = True
            self.dropped += len(self._queue) + len(self._held)
            self._queue.clear()
            self._asked.clear()
            self._queued_bytes = self._held_bytes = 0
            held, self._held = self._held, collections.deque()
        for *_, release in held:
            release()
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.005)

    def _ceiling(self) -> int:
        shared_by = len(live(self._share.folder)) if self._share is not None else 1
        return max(1, self.concurrency // shared_by)

    def request(self, objects: Iterable[tuple[str, int, Any]]) -> None:
        """Queue these (URL, bytes, what `fetch` is given with it), first to be needed first;
        already requested ones are skipped. Nothing is kept of an object once fetched: memory is
        bounded by what waits."""
        with self._lock:
            for url, size, what in objects:
                if url not in self._asked:
                    self._asked.add(url)
                    self._queue.append((url, size, what, 0, 0.0))
                    self._queued_bytes += size
            while len(self._queue) > self.depth:
                url, size, *_ = self._queue.pop()
                self._asked.discard(url)
                self._queued_bytes -= size
                self.dropped += 1
        self._loop.call_soon_threadsafe(self._pump)

    def counters(self) -> dict[str, int]:
        """What the pool did and holds: requests in flight now and at most, its limit now and at
        its lowest, objects and bytes fetched (those found with nothing to fetch among them:
        `skipped`), throttling answers, retries, failures, queue, objects claimed ahead of their
        GETs."""
        with self._lock:
            return {
                "in_flight": self.in_flight,
                "peak_in_flight": self.peak_in_flight,
                "limit": int(self._limit.value),
                "lowest_limit": self._limit.lowest,
                "ceiling": self._limit.ceiling,
                "memory": self.in_flight_bytes,
                "peak_memory": self.peak_memory,
                "fetched": self.fetched,
                "skipped": self.skipped,
                "bytes": self.bytes,
                "throttled": self.throttled,
                "retried": self.retried,
                "failed": self.failed,
                "dropped": self.dropped,
                "queued": len(self._queue),
                "queued_bytes": self._queued_bytes,
                "claimed": len(self._held),
            }

    def _pump(self) -> None:
        """Claim what the queue holds up to the ceiling (`_claim_ahead`), then start GETs of the
        claimed while the limits allow (on the loop's thread), STARTS_PER_TURN per turn of the
        loop: preparing a request costs the client about a millisecond of CPU, so starting a
        whole limit's worth at once would keep the answers to the first ones (those the first
        batch waits for) unread for as long as it takes to send the last."""
        now = time.monotonic()
        with self._lock:
            if self._closed:
                return
            if self._share is not None and now - self._counted_at > RECOUNT:
                self._counted_at = now
                self._limit.set_ceiling(self._ceiling())
            failed, more = self._claim_ahead(now)
            started = 0
            while self._held and self.in_flight < int(self._limit.value):
                if started == STARTS_PER_TURN:
                    more = True
                    break
                url, size, what, tries, since, given, release = self._held[0]
                if self.in_flight and self.in_flight_bytes + size > self.memory:
                    break
                started += 1
                self._held.popleft()
                self._held_bytes -= size
                self.in_flight += 1
                self.in_flight_bytes += size
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
                self.peak_memory = max(self.peak_memory, self.in_flight_bytes)
                item = (url, size, what, tries, since)
                self._loop.create_task(self._one(item, given, release, self._limit.round))
            if more:
                self._loop.call_soon(self._pump)  # after the answers that arrived meanwhile
        for exc, item in failed:
            self._failed(exc, item, self._limit.round)

    def _claim_ahead(self, now: float) -> tuple[list[tuple[Exception, _Item]], bool]:
        """Claim objects of the queue (`claim`) while the claimed and those in flight are fewer
        than the ceiling and `room` allows (their bytes counted as under way): a reader that gets
        to one before its GET starts waits for it, instead of making one of its own (a worker's
        first batch, which the slow start holds back, did so at every job's start). At most
        CLAIMS_PER_TURN (each is disk work on the loop). Under the pool's lock; returns the claims
        that failed, for `_failed`, and whether more are to be made."""
        failed: list[tuple[Exception, _Item]] = []
        for _ in range(CLAIMS_PER_TURN):
            if not self._queue or len(self._held) + self.in_flight >= self._limit.ceiling:
                return failed, False
            url, size, what, tries, since = self._queue[0]
            got: tuple[Any, Callable[[], None]] | Exception | None
            try:
                if self._room is not None and not self._room(size, self.in_flight_bytes + self._held_bytes):
                    if self._room_poll is None:  # the readers make room, not an answer: ask again
                        self._room_poll = self._loop.call_later(ROOM_POLL, self._poll_room)
                    return failed, False
                got = self._claim(url, what) if self._claim is not None else (what, _unclaimed)
            except Exception as exc:  # noqa: BLE001 - counted and named as a failed GET is; its reader fetches it
                got = exc
            self._queue.popleft()
            self._asked.discard(url)
            self._queued_bytes -= size
            if isinstance(got, Exception):
                failed.append((got, (url, size, what, tries, since or now)))
                continue
            if got is None:  # nothing to fetch: cached, downloaded by another, read already
                self._limit.succeeded()
                self.fetched += 1
                self.skipped += 1
                self.bytes += size
                continue
            self._held.append((url, size, what, tries, since or now, *got))
            self._held_bytes += size
        return failed, bool(self._queue)

    def _poll_room(self) -> None:
        self._room_poll = None
        self._pump()

    async def _one(self, item: _Item, given: Any, release: Callable[[], None], sent_in_round: int) -> None:
        url, size = item[:2]
        try:
            async with asyncio.timeout(self._policy.attempt_deadline(size)):  # no task of its own, as wait_for's
                await self._fetch(url, given)
        except Exception as exc:  # noqa: BLE001 - counted and named; the read that needs it raises it
            self._failed(exc, item, sent_in_round)
        else:
            with self._lock:
                self._limit.succeeded()
                self.fetched += 1
                self.bytes += size
        finally:
            with self._lock:
                self.in_flight -= 1
                self.in_flight_bytes -= size
            try:
                release()
            finally:
                self._pump()

    def _failed(self, exc: Exception, item: _Item, sent_in_round: int) -> None:
        """Count a failed GET; try it again later if it is a transient fault within the policy's
        attempts and deadline."""
        url, size, what, tries, since = item
        pause = self._policy.delay(tries)
        transient = isinstance(exc, TimeoutError) or is_transient(exc)
        with self._lock:
            if is_throttling(exc):
                self.throttled += 1
                self._limit.throttled(sent_in_round)
            if (
                transient
                and tries + 1 < self._policy.attempts
                and time.monotonic() + pause - since < self._policy.deadline
            ):
                self.retried += 1
                self._loop.call_later(pause, self._again, (url, size, what, tries + 1, since))
                return
            self.failed += 1
            self.errors.append(f"{url}: {type(exc).__name__}: {exc}")

    def _again(self, item: _Item) -> None:
        with self._lock:
            if self._closed:
                return
            self._queue.appendleft(item)
            self._asked.add(item[0])
            self._queued_bytes += item[1]
        self._pump()


def _unclaimed() -> None:
    """The release of an object a pool without `claim` fetches: nothing was claimed."""


def _close_at_exit(pool: weakref.ref[FetchAhead]) -> None:
    alive = pool()
    if alive is not None:
        alive.close()


def client_loop() -> asyncio.AbstractEventLoop:
    """The event loop the storage clients run on (fsspec's I/O thread, one per process)."""
    from fsspec.asyn import get_loop  # type: ignore[import-untyped]

    loop: asyncio.AbstractEventLoop = get_loop()
    return loop
