"""Retries of remote calls: transient faults again with backoff and jitter, permanent ones never.

One policy for every remote call (info, ranged and whole reads, uploads): at most `attempts`
tries within `deadline` seconds, sleeping `base * 2**n` (capped at `cap`) times a random factor
in [0.5, 1.5) between tries, so that many workers hit by one throttling burst spread out. Each
try has a deadline of its own (`RetryPolicy.attempt_deadline`): the client's read timeout only
bounds the wait for the next byte, so a server sending one byte before each timeout would hold a
try forever. A transient fault (a too slow try and a corrupted transfer among them) that outlasts
the tries is a RemoteReadError naming the URL, the attempts and the time; a permanent one (not
found, access denied, bad credentials) is a RemoteAccessError at once.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from globalloader.errors import GlobalLoaderError, RemoteAccessError, RemoteReadError
from globalloader.storage._fs import http_status, is_denied, is_transient

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try one remote call: attempts, backoff base and cap, total deadline (s), and
    how slow one try may be: `grace` seconds plus its bytes at `min_rate` bytes/s."""

    attempts: int = 8
    base: float = 0.05
    cap: float = 2.0
    deadline: float = 120.0
    min_rate: float = 100e3
    grace: float = 30.0

    def delay(self, attempt: int) -> float:
        """Seconds to sleep after failed try number `attempt` (0-based), with jitter."""
        return min(self.cap, self.base * 2**attempt) * random.uniform(0.5, 1.5)

    def attempt_deadline(self, nbytes: int | None) -> float:
        """Seconds one try moving `nbytes` may take in all (connect, first byte, every byte):
        `grace + nbytes / min_rate`; a call of unknown size (a listing) gets `deadline`."""
        return self.deadline if nbytes is None else self.grace + nbytes / self.min_rate


DEFAULT = RetryPolicy()


def call(fn: Callable[[float], T], url: str, what: str, policy: RetryPolicy = DEFAULT, nbytes: int | None = 0) -> T:
    """`fn(seconds)`, retried on transient faults by `policy`; errors name `what` was done to
    `url`. `fn` must give up after `seconds` (the try's deadline for `nbytes` bytes) with a
    TimeoutError (fsspec's FSTimeoutError is one)."""
    start = time.monotonic()
    attempt = 0
    seconds = policy.attempt_deadline(nbytes)
    while True:
        try:
            return fn(seconds)
        except GlobalLoaderError:
            raise
        except Exception as exc:
            attempt += 1
            if not is_transient(exc):
                raise _permanent(exc, url, what) from exc
            spent = time.monotonic() - start
            pause = policy.delay(attempt - 1)
            if attempt >= policy.attempts or spent + pause > policy.deadline:
                last = _too_slow(seconds, nbytes) if _timed_out(exc) else _describe(exc)
                raise RemoteReadError(
                    f"cannot {what} {url}: {attempt} attempt(s) in {spent:.1f} s all failed "
                    f"with transient faults, the last: {last}"
                ) from exc
            time.sleep(pause)


def _timed_out(exc: BaseException) -> bool:
    """Whether `exc` is a try cut at its deadline (fsspec's FSTimeoutError, by name: fsspec is
    never imported for a local run)."""
    return any(cls.__name__ == "FSTimeoutError" for cls in type(exc).__mro__)


def _too_slow(seconds: float, nbytes: int | None) -> str:
    size = "a call of unknown size gets RetryPolicy.deadline" if nbytes is None else f"{nbytes} bytes"
    return (
        f"too slow: no whole answer within {seconds:.3g} s ({size}; RetryPolicy.grace and "
        "RetryPolicy.min_rate set this deadline of each attempt)"
    )


def _permanent(exc: BaseException, url: str, what: str) -> RemoteAccessError:
    if isinstance(exc, FileNotFoundError) or http_status(exc) == 404:
        return RemoteAccessError(f"file not found: {url}")
    if is_denied(exc):
        # The first line: a client may add the server's whole answer (an XML or JSON body) below it.
        said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return RemoteAccessError(f"access denied to {url} (check the credentials or storage_options=): {said}")
    return RemoteAccessError(f"cannot {what} {url}: {_describe(exc)}")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
