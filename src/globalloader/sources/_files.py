"""Opening files by URL: local paths directly, every other scheme through fsspec.

One small table maps a URL scheme to an opener. Local paths (no `scheme://`) get os-level calls
(`os.pread` on descriptors kept open per process); anything else (`file://`, `memory://`,
`s3://`, ...) goes to fsspec, imported lazily as the `remote` extra.
"""

from __future__ import annotations

import contextlib
import glob as _glob
import os
import threading
import weakref
from collections.abc import Iterable
from typing import IO, Any, NamedTuple

from globalloader import _extras
from globalloader.errors import ArgumentError, SourceError
from globalloader.sources._braces import expand_braces

_GLOB_CHARS = frozenset("*?[")
# fsspec `info()` fields that change when an object's content changes, most specific first.
_VERSION_FIELDS = ("ETag", "etag", "md5", "generation", "mtime", "LastModified", "last_modified", "updated", "created")


class FileStat(NamedTuple):
    """Size and a version string (mtime or ETag) that changes when the content changes."""

    size: int
    version: str


def scheme_of(url: str) -> str:
    """Return the URL's scheme, or "" for a local path."""
    head, sep, _ = url.partition("://")
    return head if sep and "/" not in head else ""


class _LocalOpener:
    """Plain paths: the os module, no extra dependency."""

    @staticmethod
    def stat(url: str) -> FileStat:
        try:
            st = os.stat(url)
        except FileNotFoundError:
            raise SourceError(f"file not found: {url}") from None
        except OSError as exc:
            raise SourceError(f"cannot stat {url}: {exc.strerror}") from None
        if not os.path.isfile(url):
            raise SourceError(f"not a regular file: {url}")
        return FileStat(st.st_size, str(st.st_mtime_ns))

    @staticmethod
    def open(url: str, mode: str) -> IO[bytes]:
        try:
            parent = os.path.dirname(url)
            if "w" in mode and parent:
                os.makedirs(parent, exist_ok=True)
            return open(url, mode)
        except OSError as exc:
            raise SourceError(f"cannot open {url}: {exc.strerror}") from None

    @staticmethod
    def glob(pattern: str) -> list[str]:
        return sorted(_glob.glob(pattern))

    @staticmethod
    def key(url: str) -> str:
        return os.path.abspath(url)


class _FsspecOpener:
    """Every URL with a scheme, including file://, through fsspec's filesystem registry."""

    @staticmethod
    def fs(url: str) -> tuple[Any, str]:
        fsspec = _extras.require("fsspec", "remote")
        try:
            return fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as exc:
            raise SourceError(f"cannot open {url}: {exc}") from None

    @classmethod
    def stat(cls, url: str) -> FileStat:
        fs, path = cls.fs(url)
        try:
            info = fs.info(path)
        except FileNotFoundError:
            raise SourceError(f"file not found: {url}") from None
        except OSError as exc:
            raise SourceError(f"cannot stat {url}: {exc}") from None
        if info.get("type", "file") != "file":
            raise SourceError(f"not a regular file: {url}")
        version = next((str(info[f]) for f in _VERSION_FIELDS if info.get(f) is not None), "")
        return FileStat(int(info["size"]), version)

    @classmethod
    def open(cls, url: str, mode: str) -> IO[bytes]:
        fs, path = cls.fs(url)
        try:
            return fs.open(path, mode)
        except OSError as exc:
            raise SourceError(f"cannot open {url}: {exc}") from None

    @classmethod
    def glob(cls, pattern: str) -> list[str]:
        fs, path = cls.fs(pattern)
        return sorted(fs.unstrip_protocol(p) for p in fs.glob(path))

    @staticmethod
    def key(url: str) -> str:
        return url


_OPENERS: dict[str, type[_LocalOpener | _FsspecOpener]] = {"": _LocalOpener}


def _opener(url: str) -> type[_LocalOpener | _FsspecOpener]:
    return _OPENERS.get(scheme_of(url), _FsspecOpener)


def stat(url: str) -> FileStat:
    """Size and version of one file; SourceError naming it when it is missing."""
    return _opener(url).stat(url)


def open_file(url: str, mode: str = "rb") -> IO[bytes]:
    """Open a binary file object for sequential reading or writing."""
    return _opener(url).open(url, mode)


def cache_key(url: str) -> str:
    """A location string stable across working directories (absolute path for local files)."""
    return _opener(url).key(url)


def expand_urls(urls: Any, argument: str) -> list[str]:
    """Turn a str, path or list of them into a list of URLs: braces first, then globs.

    A pattern with glob characters that matches nothing is a SourceError naming it; an empty
    result or a wrong type is an ArgumentError naming `argument`.
    """
    if isinstance(urls, (str, os.PathLike)):
        urls = [urls]
    elif not isinstance(urls, Iterable) or isinstance(urls, (bytes, dict)):
        raise ArgumentError(f"{argument} must be a str, a path or a list of them, got {type(urls).__name__}")
    expanded: list[str] = []
    for item in urls:
        if not isinstance(item, (str, os.PathLike)):
            raise ArgumentError(f"{argument} items must be str or paths, got {type(item).__name__}")
        for url in expand_braces(os.fspath(item)):
            if _GLOB_CHARS.isdisjoint(url) or os.path.exists(url):
                expanded.append(url)
                continue
            matches = _opener(url).glob(url)
            if not matches:
                raise SourceError(f"no file matches {url!r}")
            expanded.extend(matches)
    if not expanded:
        raise ArgumentError(f"{argument} is empty")
    return expanded


class RangeReader:
    """Ranged reads from many files, handles opened lazily and kept per process.

    Local files: one descriptor per file, opened on first use and read with `os.pread`, which
    needs no seek and is safe from many threads at once. Descriptors are never pickled, and a
    forked child drops the ones it inherited (an at-fork hook, so reads pay no pid check) and
    reopens its own. At most `max_open` descriptors stay open; reads from further files open
    and close each time. Remote files: `fs.cat_file(path, start, end)`, one request per read.
    """

    def __init__(self, max_open: int = 256) -> None:
        self.max_open = max_open
        self._reset()
        reset_in_forked_children(self)

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._fds: dict[str, int] = {}
        self._remote: dict[str, tuple[Any, str]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"max_open": self.max_open}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.max_open = state["max_open"]
        self._reset()
        reset_in_forked_children(self)

    def read(self, url: str, start: int, length: int) -> bytes:
        """Up to `length` bytes at `start` (fewer only at the end of the file)."""
        if scheme_of(url):
            return self.read_remote(url, start, length)
        return self.read_local(url, start, length)

    def read_local(self, url: str, start: int, length: int) -> bytes:
        """`read` for a path known to be local (skips the scheme check on hot paths)."""
        fd = self._fds.get(url)
        if fd is None:
            return self._read_local_cold(url, start, length)
        return _pread_full(fd, length, start, url)

    def read_remote(self, url: str, start: int, length: int) -> bytes:
        """`read` for a URL known to have a scheme."""
        fs, path = self._remote.get(url) or self._open_remote(url)
        try:
            return fs.cat_file(path, start=start, end=start + length)
        except OSError as exc:
            raise SourceError(f"cannot read {url} at offset {start}: {exc}") from None

    def _open_remote(self, url: str) -> tuple[Any, str]:
        self._remote[url] = handle = _FsspecOpener.fs(url)
        return handle

    def _read_local_cold(self, url: str, start: int, length: int) -> bytes:
        # Open outside the lock; the lock only decides whether the descriptor is kept (a thread
        # that lost the race closes its own). Kept descriptors are closed only by close().
        fd = _open_fd(url)
        with self._lock:
            kept = self._fds.get(url)
            if kept is None and len(self._fds) < self.max_open:
                self._fds[url] = kept = fd
        if kept == fd:
            return _pread_full(fd, length, start, url)
        try:
            return _pread_full(kept if kept is not None else fd, length, start, url)
        finally:
            os.close(fd)

    def _after_fork(self) -> None:
        # The inherited descriptors are the parent's bookkeeping; close the child's copies only.
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._reset()

    def close(self) -> None:
        """Close this process's descriptors (reads reopen them)."""
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._reset()


_FORK_AWARE: weakref.WeakSet[Any] = weakref.WeakSet()


def reset_in_forked_children(obj: Any) -> None:
    """Call `obj._after_fork()` in every child forked from now on (`obj` is held weakly).

    A hook at fork time, not a pid check per read, keeps the hot path free of a system call.
    """
    _FORK_AWARE.add(obj)


def _after_fork_in_child() -> None:
    for obj in list(_FORK_AWARE):
        obj._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _open_fd(url: str) -> int:
    try:
        return os.open(url, os.O_RDONLY)
    except FileNotFoundError:
        raise SourceError(f"file not found: {url}") from None
    except OSError as exc:
        raise SourceError(f"cannot open {url}: {exc.strerror}") from None


def _pread_full(fd: int, length: int, start: int, url: str) -> bytes:
    try:
        data = os.pread(fd, length, start)
        if len(data) == length or not data:
            return data
        # Linux caps one read near 2 GiB; loop for huge members, stop at the end of the file.
        parts = [data]
        got = len(data)
        while got < length:
            more = os.pread(fd, length - got, start + got)
            if not more:
                break
            parts.append(more)
            got += len(more)
        return b"".join(parts)
    except OSError as exc:
        raise SourceError(f"cannot read {url} at offset {start}: {exc.strerror}") from None
