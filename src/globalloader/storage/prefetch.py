"""Background downloads into the machine cache, ahead of the reads that will need them.

A few daemon threads per process take URL requests in order, skip ones already queued or
downloading, and fetch each into the cache (an object already there costs an open, no request);
at most `depth` wait in the queue (the newest requests beyond it are dropped: the readers fetch
them themselves when they get there). A failed prefetch is not an error: the read that needs
the object fetches it again and raises what fails. Daemon threads never delay the exit.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable

from globalloader.errors import GlobalLoaderError

IN_FLIGHT = 4  # objects downloading at once per process
DEPTH = 64  # requests waiting at most


class Prefetcher:
    """Runs `fetch(url)` for requested URLs on `threads` daemon threads, each URL once."""

    def __init__(self, fetch: Callable[[str], None], threads: int = IN_FLIGHT, depth: int = DEPTH) -> None:
        self._fetch, self._threads, self._depth = fetch, threads, depth
        self._queue: collections.deque[str] = collections.deque()
        self._asked: set[str] = set()  # queued or downloading
        self._cond = threading.Condition()
        self._started = False
        self.failures = 0  # prefetches that failed (the reads then fetch and report)

    def request(self, urls: Iterable[str]) -> None:
        """Queue these URLs (first to be needed first); already requested ones are skipped."""
        with self._cond:
            for url in urls:
                if url not in self._asked:
                    self._asked.add(url)
                    self._queue.append(url)
            while len(self._queue) > self._depth:
                self._asked.discard(self._queue.pop())
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
                url = self._queue.popleft()
            try:
                self._fetch(url)
            except (GlobalLoaderError, OSError):
                self.failures += 1
            finally:
                with self._cond:
                    self._asked.discard(url)
