"""Retries of remote calls: transient faults again with backoff and jitter, permanent ones never.

One policy for every remote call (info, ranged and whole reads, uploads): at most `attempts`
tries within `deadline` seconds, sleeping `base * 2**n` (capped at `cap`) times a random factor
in [0.5, 1.5) between tries, so that many workers hit by one throttling burst spread out. A
transient fault that outlasts them is a RemoteReadError naming the URL, the attempts and the time;
a permanent one (not found, access denied, bad credentials) is a RemoteAccessError at once.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from globalloader.errors import GlobalLoaderError, RemoteAccessError, RemoteReadError
from globalloader.storage._fs import is_transient

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try one remote call: attempts, backoff base and cap, total deadline (s)."""

    attempts: int = 8
    base: float = 0.05
    cap: float = 2.0
    deadline: float = 120.0

    def delay(self, attempt: int) -> float:
        """Seconds to sleep after failed try number `attempt` (0-based), with jitter."""
        return min(self.cap, self.base * 2**attempt) * random.uniform(0.5, 1.5)


DEFAULT = RetryPolicy()


def call(fn: Callable[[], T], url: str, what: str, policy: RetryPolicy = DEFAULT) -> T:
    """`fn()`, retried on transient faults by `policy`; errors name `what` was done to `url`."""
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return fn()
        except GlobalLoaderError:
            raise
        except Exception as exc:
            attempt += 1
            if not is_transient(exc):
                raise _permanent(exc, url, what) from exc
            spent = time.monotonic() - start
            pause = policy.delay(attempt - 1)
            if attempt >= policy.attempts or spent + pause > policy.deadline:
                raise RemoteReadError(
                    f"cannot {what} {url}: {attempt} attempt(s) in {spent:.1f} s all failed "
                    f"with transient faults, the last: {_describe(exc)}"
                ) from exc
            time.sleep(pause)


def _permanent(exc: BaseException, url: str, what: str) -> RemoteAccessError:
    if isinstance(exc, FileNotFoundError):
        return RemoteAccessError(f"file not found: {url}")
    if isinstance(exc, PermissionError):
        return RemoteAccessError(f"access denied to {url} (check the credentials or storage_options=): {exc}")
    return RemoteAccessError(f"cannot {what} {url}: {_describe(exc)}")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
