"""What every shard writer shares: a printf pattern, rolling over at maxcount/maxsize, numbering."""

from __future__ import annotations

import os
import re
from types import TracebackType
from typing import Any, Self

from globalloader import storage
from globalloader.errors import ArgumentError, check_int

# A printf integer field, as `pattern % number` fills it: %d, %06d, %x, ...
_FIELD = re.compile(r"%[-#0 +]*\d*[diouxX]")


class ShardSeries:
    """Shards named by `pattern` (a plain path: one shard; with a printf field such as
    `out-%06d.tar`: numbered from `first_shard`), each holding at most `maxcount` samples and
    `maxsize` bytes (as the writer counts them; a sample is never split, a shard holds at least
    one). Writers call `_full(nbytes)` before each sample and `_added(nbytes)` after, and give
    `_finish()` (publish the shard being filled) and `_drop()` (forget it, never published): the
    lifecycle (`close`, `abort`, `with`) is this class's."""

    def __init__(
        self,
        pattern: str | os.PathLike[str],
        maxcount: int | None,
        maxsize: int | None,
        storage_options: dict[str, Any] | None,
        first_shard: int,
    ) -> None:
        if not isinstance(pattern, (str, os.PathLike)):
            raise ArgumentError(f"pattern must be a str or path, got {type(pattern).__name__}")
        self.pattern = os.fspath(pattern)
        self.store = storage.Store(storage_options)
        check_limits(maxcount, maxsize)
        self._numbered = has_number_field(self.pattern)
        if (maxcount or maxsize) and not self._numbered:
            raise ArgumentError(
                f"pattern {self.pattern!r} has no printf field such as %06d, so it cannot roll over at maxcount/maxsize"
            )
        self.maxcount, self.maxsize = maxcount, maxsize
        self.first_shard = check_int(first_shard, "first_shard")
        self.paths: list[str] = []
        self._count = self._size = 0
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ArgumentError(f"write() on a closed {type(self).__name__}({self.pattern!r})")

    def _finish(self) -> None:
        raise NotImplementedError

    def _drop(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Drop the shard being written (it never appears) and close: for a writer whose input
        failed, so that no shard short of its samples looks finished."""
        self._drop()
        self._closed = True

    def close(self) -> None:
        """Finish the current shard. Closing twice is harmless."""
        if not self._closed:
            self._finish()
            self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _full(self, nbytes: int) -> bool:
        if self.maxcount is not None and self._count >= self.maxcount:
            return True
        return self.maxsize is not None and self._count > 0 and self._size + nbytes > self.maxsize

    def _new_path(self) -> str:
        """The next shard's path, counted in `paths`."""
        if not self._numbered and self.paths:
            raise ArgumentError(f"pattern {self.pattern!r} names one shard only")
        path = self.pattern % (self.first_shard + len(self.paths)) if self._numbered else self.pattern
        self.paths.append(path)
        self._count = self._size = 0
        return path

    def _added(self, nbytes: int) -> None:
        self._count += 1
        self._size += nbytes


def check_limits(maxcount: int | None, maxsize: int | None) -> None:
    """ArgumentError naming `maxcount` or `maxsize` unless each is a positive int or None."""
    for name, value in (("maxcount", maxcount), ("maxsize", maxsize)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ArgumentError(f"{name} must be a positive int or None, got {value!r}")


def has_number_field(pattern: str) -> bool:
    """Whether `pattern` holds a printf field that shard numbers fill; ArgumentError if it is
    not a valid printf pattern (a stray % that is not %%)."""
    try:
        return pattern % 0 != pattern
    except TypeError:
        return False
    except ValueError as exc:
        raise ArgumentError(f"pattern {pattern!r} is not a valid printf pattern: {exc}") from None


def number_field(pattern: str) -> re.Match[str] | None:
    """The printf integer field of `pattern`, if it has one."""
    return _FIELD.search(pattern.replace("%%", "\0\0"))
