"""Background downloads into the machine cache, ahead of the reads that will need them.

A few daemon threads per process take URL requests in order, skip ones already queued, and
fetch each into the cache (an object already there costs an open, no request). One asked for again
while it downloads is queued again: the request may follow a read of it (a new epoch's: the
download made it visible before its thread was done), so its turn finds it cached or fetches it;
at most `depth` requests wait in the queue (the newest requests beyond are dropped: the readers
fetch them themselves when they get there). With `room(bytes, in_flight)`, the next request starts
only once it says there is room for it beside the downloads under way (the cache's room for
objects fetched and not read yet, see `ObjectCache.room_ahead`), asked again every ROOM_POLL
seconds: requests start in order, never the later ones first. A failed prefetch is not an error:
the read that needs the object fetches it again and raises what fails. Daemon threads never
delay the exit.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable

from globalloader.errors import GlobalLoaderError

IN_FLIGHT = 4  # objects downloading at once per process
# Requests waiting at most: as many as the loader's horizon names (4096 samples ahead, one object
# each at most, as for ImageFolder), so that none it names is dropped and left to the workers.
DEPTH = 4096
ROOM_POLL = 0.005  # seconds between two asks for room while there is none


class Prefetcher:
    """Runs `fetch(url)` for requested (URL, bytes) on `threads` daemon threads, in order as
    `room` allows, each URL queued once at a time; the requests waiting hold at most `depth` URLs."""

    def __init__(
        self,
        fetch: Callable[[str], None],
        threads: int = IN_FLIGHT,
        depth: int = DEPTH,
        room: Callable[[int, int], bool] | None = None,
    ) -> None:
        self._fetch, self._threads, self._depth, self._room = fetch, threads, depth, room
        self._queue: collections.deque[tuple[str, int]] = collections.deque()  # (url, bytes)
        self._queued: set[str] = set()
        self._in_flight = 0  # bytes downloading
        self._cond = threading.Condition()
        self._started = False
        self.failures = 0  # prefetches that failed (the reads then fetch and report)

    def request(self, objects: Iterable[tuple[str, int]]) -> None:
        """Queue these (URL, bytes) (first to be needed first); ones queued already are skipped."""
        with self._cond:
            for url, size in objects:
                if url not in self._queued:
                    self._queued.add(url)
                    self._queue.append((url, size))
            while len(self._queue) > self._depth:
                self._queued.discard(self._queue.pop()[0])
            if not self._started:
                self._started = True
                for n in range(self._threads):
                    threading.Thread(target=self._run, name=f"gl-prefetch-{n}", daemon=True).start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue or (
                    self._room is not None and not self._room(self._queue[0][1], self._in_flight)
                ):
                    self._cond.wait(ROOM_POLL if self._queue else None)
                url, size = self._queue.popleft()
                self._queued.discard(url)
                self._in_flight += size
            try:
                self._fetch(url)
            except (GlobalLoaderError, OSError):
                self.failures += 1
            finally:
                with self._cond:
                    self._in_flight -= size
                    self._cond.notify_all()
