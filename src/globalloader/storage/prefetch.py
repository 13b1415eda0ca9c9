"""Background downloads into the machine cache, ahead of the reads that will need them.

A few daemon threads per process take URL requests in order, skip ones already queued or
downloading, and fetch each into the cache (an object already there costs an open, no request);
at most `depth` requests and `budget` bytes wait in the queue (the newest requests beyond either
are dropped: the readers fetch them themselves when they get there). A failed prefetch is not an
error: the read that needs the object fetches it again and raises what fails. Daemon threads never delay the exit.
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


class Prefetcher:
    """Runs `fetch(url)` for requested URLs on `threads` daemon threads, each URL once; the
    requests waiting hold at most `depth` URLs and `budget` bytes (one, whatever its size)."""

    def __init__(
        self, fetch: Callable[[str], None], threads: int = IN_FLIGHT, depth: int = DEPTH, budget: int | None = None
    ) -> None:
        self._fetch, self._threads, self._depth, self._budget = fetch, threads, depth, budget
        self._queue: collections.deque[tuple[str, int]] = collections.deque()  # (url, bytes)
        self._queued_bytes = 0
        self._asked: set[str] = set()  # queued or downloading
        self._cond = threading.Condition()
        self._started = False
        self.failures = 0  # prefetches that failed (the reads then fetch and report)

    def request(self, objects: Iterable[tuple[str, int]]) -> None:
        """Queue these (URL, bytes) (first to be needed first); already requested ones are skipped."""
        with self._cond:
            for url, size in objects:
                if url not in self._asked:
                    self._asked.add(url)
                    self._queue.append((url, size))
                    self._queued_bytes += size
            while len(self._queue) > 1 and (
                len(self._queue) > self._depth or (self._budget is not None and self._queued_bytes > self._budget)
            ):
                url, size = self._queue.pop()
                self._asked.discard(url)
                self._queued_bytes -= size
            if not self._started:
                self._started = True
                for n in range(self._threads):
                    threading.Thread(target=self._run, name=f"gl-prefetch-{n}", daemon=True).start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                url, size = self._queue.popleft()
                self._queued_bytes -= size
            try:
                self._fetch(url)
            except (GlobalLoaderError, OSError):
                self.failures += 1
            finally:
                with self._cond:
                    self._asked.discard(url)
