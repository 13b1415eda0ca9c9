"""FolderListing: every file below a remote folder, listed once per machine and kept.

Listing a folder of a million objects takes a thousand LIST requests and minutes; a dict of a
million paths to sizes and versions costs each worker its own copy of ~200 MB (reading a Python
object writes its reference count, so forked workers copy the pages they touch). So a listing is
kept in the cache folder (`listings/`, one file per folder URL and endpoint) as flat arrays:
names and versions as one byte buffer each with their offsets, sizes as int64. Every process
maps the same file read-only: a job, its workers and the next job on the machine share one copy
in the page cache and list nothing. What a source makes of a listing (the rows it takes, in its
order, and their labels: a pass over a million names, tens of seconds) is kept beside it the
same way (`FolderListing.derived`), made by the first job and mapped by the others and by every
worker, which receive the files' paths, not the arrays.

Refreshing: by default (`max_age` 0) a source sees the folder as it was when it was constructed:
jobs that start together list it once (the first lists under a lock file per folder, the others
wait for it and map its listing, which was under way when they asked), and a source made later
lists it again; workers map the file rather than list or copy. A folder that is not rewritten (a dataset)
can be listed once per machine: with `max_age` seconds (argument, else
$GLOBALLOADER_LISTING_MAX_AGE) the newest kept listing younger than that is used by every job as
it is. Either way an object rewritten since its
listing is never served under the old version (its reads ask for the listed ETag: a SourceError
telling to construct the source again with a fresh listing); one deleted since is a
RemoteAccessError naming it. Each listing is a file of its
own (named by the folder and the listing time, written whole by `write_atomic`), so a job's
workers map exactly the listing their source was made from; files of a folder older than
`KEEP_OLD` seconds are removed when it is listed again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import struct
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from globalloader import _paths
from globalloader.errors import ArgumentError, SourceError
from globalloader.storage.cache import LOCK_TIMEOUT
from globalloader.storage.cache_stats import lock_exclusive

MAX_AGE_ENV = "GLOBALLOADER_LISTING_MAX_AGE"
DEFAULT_MAX_AGE = 0.0  # seconds a kept listing is used before the folder is listed again
KEEP_OLD = 86400.0  # seconds a replaced listing is kept for the workers of jobs still using it
_MAGIC = b"GLLIST1\n"
_HEAD = struct.Struct("<8sQ")  # magic, bytes of the JSON header that follows
_SECRET_PARTS = ("key", "secret", "token", "password", "credential")


class _Flat:
    """Strings as one byte buffer and the offsets of its items (reading them touches no object).
    An item is read through a memoryview of the buffer: a slice of a memmap runs numpy's Python
    (`memmap.__array_finalize__`), four times the cost of the whole read, twice an object."""

    def __init__(self, offsets: np.ndarray, data: np.ndarray) -> None:
        self.offsets, self.data = offsets, data
        self._bytes = data.data  # the array's buffer as a memoryview

    def __reduce__(self) -> tuple[type[_Flat], tuple[np.ndarray, np.ndarray]]:
        return _Flat, (self.offsets, self.data)  # a memoryview is not pickled: made again there

    @staticmethod
    def encode(items: list[str]) -> tuple[np.ndarray, bytes]:
        encoded = [s.encode("utf-8", "surrogatepass") for s in items]
        offsets = np.zeros(len(items) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, encoded), np.int64, len(items)), out=offsets[1:])
        return offsets, b"".join(encoded)

    def __getitem__(self, index: int) -> str:
        return str(self._bytes[self.offsets.item(index) : self.offsets.item(index + 1)], "utf-8", "surrogatepass")


def flat_strings(items: list[str]) -> _Flat:
    """`items` as one `_Flat` in memory (a local folder's names, which are not kept)."""
    offsets, data = _Flat.encode(items)
    return _Flat(offsets, np.frombuffer(data, np.uint8))


class FolderListing:
    """The files below `root` (relative names, sorted), their sizes and versions, as arrays."""

    def __init__(
        self, path: pathlib.Path, root: str, listed_at: float, names: _Flat, sizes: np.ndarray, versions: _Flat
    ) -> None:
        self.path, self.root, self.listed_at = path, root, listed_at
        self.names, self.sizes, self.versions = names, sizes, versions

    def __reduce__(self) -> tuple[Any, tuple[pathlib.Path, str]]:
        # A process it is sent to maps the file again rather than receiving a copy of the arrays.
        return _reopen, (self.path, self.root)

    def __len__(self) -> int:
        return len(self.sizes)

    def derived(self, name: str, derive: Callable[[], tuple[dict[str, np.ndarray], dict[str, Any]]]) -> KeptArrays:
        """What a source makes of this listing (`derive`: 1-D arrays such as the rows it takes, in
        its order, and their labels, and JSON-able `meta`), made once per machine for `name` and
        kept beside the listing: the next job maps it instead of passing over a million names
        (jobs starting together: one makes it under the folder's lock, the others wait)."""
        path = self.path.with_name(f"{self.path.stem}.{hashlib.sha1(name.encode()).hexdigest()[:16]}.gld")
        kept = _load_derived(path, name)
        if kept is not None:
            return kept
        with _listing_lock(self.path.with_name(f"{self.path.name.split('.')[0]}.lock"), self.root):
            kept = _load_derived(path, name)  # made by another job while this one waited
            if kept is not None:
                return kept
            arrays, meta = derive()
            dtypes = {key: array.dtype.str for key, array in arrays.items()}
            parts = [np.ascontiguousarray(array).tobytes() for array in arrays.values()]
            _write_arrays(path, {"name": name, "dtypes": dtypes, "meta": meta}, parts)
        kept = _load_derived(path, name)
        if kept is None:
            raise SourceError(f"cannot read back what was made of the listing of {self.root} in {path}")
        return kept

    @classmethod
    def of(cls, store: Any, root: str, max_age: float | None = None) -> FolderListing:
        """The listing of the remote folder `root` through `store` (a `Store`): the kept one if
        young enough, else listed now and kept.

        Jobs that start together list a folder once: they wait for the one that lists (a lock
        file per folder, LOCK_TIMEOUT at most) and map its listing, under way when they asked.
        With `max_age` > 0 any kept listing at most that old is used, so the machine lists once."""
        age, key = _max_age(max_age), _key(root, store.storage_options)
        folder = _paths.cache_dir("listings")
        asked = time.time()
        if age > 0 and (kept := _newest(folder, key, root, asked - age)) is not None:
            return kept
        with _listing_lock(folder / f"{key}.lock", root):
            # Another job may have listed the folder while this one waited: then use its listing.
            kept = _newest(folder, key, root, asked - age if age > 0 else None, finished_after=asked)
            return kept if kept is not None else _list(store, root, folder, key)


class KeptArrays:
    """Arrays made of a kept listing (`FolderListing.derived`), mapped read-only from their file,
    and their `meta`; sent to another process as the file's path, mapped there again."""

    def __init__(self, path: pathlib.Path, name: str, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        self.path, self.name, self.arrays, self.meta = path, name, arrays, meta

    def __getitem__(self, key: str) -> np.ndarray:
        return self.arrays[key]

    def __reduce__(self) -> tuple[Any, tuple[pathlib.Path, str]]:
        return _reopen_derived, (self.path, self.name)


def _newest(
    folder: pathlib.Path, key: str, root: str, since: float | None, finished_after: float | None = None
) -> FolderListing | None:
    """The newest kept listing of `root` if it began at `since` or later, or (`finished_after`)
    was written after that moment: it was under way then, and only a listing job writes one."""
    kept = sorted(folder.glob(f"{key}.*.gll"))  # oldest first: the names end with the listing time
    newest = _load(kept[-1], root) if kept else None
    if newest is None:
        return None
    if since is not None and newest.listed_at >= since:
        return newest
    if finished_after is not None:
        with contextlib.suppress(OSError):
            if kept[-1].stat().st_mtime >= finished_after:
                return newest
    return None


def _list(store: Any, root: str, folder: pathlib.Path, key: str) -> FolderListing:
    """List `root` now, keep the listing in `folder` and map it; remove this folder's listings
    older than KEEP_OLD."""
    listed_at = time.time()
    for old in folder.glob(f"{key}.*.gl[ld]"):  # old listings and what was made of them
        with contextlib.suppress(OSError):
            if listed_at - old.stat().st_mtime > KEEP_OLD:
                old.unlink()
    path = folder / f"{key}.{time.time_ns():020d}.gll"
    found = store.find(root, remember=False)
    prefix = root.rstrip("/") + "/"
    rows = sorted((url[len(prefix) :], stat) for url, stat in found.items() if url.startswith(prefix))
    if not rows:
        raise SourceError(f"folder not found or empty: {root}")
    _save(path, root, listed_at, rows)
    loaded = _load(path, root)
    if loaded is None:
        raise SourceError(f"cannot read back the listing of {root} kept in {path}")
    return loaded


@contextlib.contextmanager
def _listing_lock(path: pathlib.Path, root: str) -> Iterator[None]:
    """The machine's lock on listing `root` and making things of its listing (released by the
    kernel when its holder dies)."""
    fd = _paths.open_file(path, os.O_RDONLY, _paths.file_mode())[0]
    try:
        waited_for = f"another process to list {root} or read its listing; if none is running, remove {path}"
        lock_exclusive(fd, LOCK_TIMEOUT, waited_for, pause_max=0.05)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)  # not only close: a forked child may hold a copy
        os.close(fd)


def _max_age(max_age: float | None) -> float:
    text = os.environ.get(MAX_AGE_ENV) if max_age is None else max_age
    try:
        age = float(DEFAULT_MAX_AGE if text in (None, "") else text)
    except (TypeError, ValueError):
        age = -1.0
    if not age >= 0:
        where = MAX_AGE_ENV if max_age is None else "listing_max_age"
        raise ArgumentError(f"{where} must be a number of seconds >= 0, got {text!r}")
    return age


def _reopen(path: pathlib.Path, root: str) -> FolderListing:
    listing = _load(path, root)
    if listing is None:
        raise SourceError(f"the listing of {root} kept in {path} is gone or damaged; construct the source again")
    return listing


def _key(root: str, options: dict[str, Any]) -> str:
    """The listing file's name: the folder's URL and where it is served from (no secrets)."""
    public = {k: v for k, v in options.items() if not any(part in k.lower() for part in _SECRET_PARTS)}
    text = json.dumps([root.rstrip("/"), public], sort_keys=True, default=repr)
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()


def _reopen_derived(path: pathlib.Path, name: str) -> KeptArrays:
    kept = _load_derived(path, name)
    if kept is None:
        raise SourceError(f"{path}, made of a kept listing, is gone or damaged; construct the source again")
    return kept


def _save(path: pathlib.Path, root: str, listed_at: float, rows: list[tuple[str, Any]]) -> None:
    name_offsets, names = _Flat.encode([rel for rel, _ in rows])
    version_offsets, versions = _Flat.encode([stat.version for _, stat in rows])
    sizes = np.fromiter((stat.size for _, stat in rows), np.int64, len(rows))
    parts = [name_offsets.tobytes(), names, sizes.tobytes(), version_offsets.tobytes(), versions]
    _write_arrays(path, {"root": root.rstrip("/"), "listed_at": listed_at, "count": len(rows)}, parts)


def _write_arrays(path: pathlib.Path, header: dict[str, Any], parts: list[bytes]) -> None:
    """`header` (JSON) and `parts`, each 8-byte aligned, written whole to `path` or not at all."""
    text = json.dumps({**header, "bytes": [len(p) for p in parts]})
    with _paths.write_atomic(path) as out:
        out.write(_HEAD.pack(_MAGIC, len(text)) + text.encode())
        for part in parts:
            out.write(part + b"\0" * (-len(part) % 8))


def _map_arrays(path: pathlib.Path) -> tuple[dict[str, Any], list[np.ndarray]] | None:
    """The header and the parts (bytes, mapped read-only) of a file `_write_arrays` wrote, or None
    when there is none or it is damaged or cut short."""
    try:
        with open(path, "rb") as f:
            magic, length = _HEAD.unpack(f.read(_HEAD.size))
            header = json.loads(f.read(length)) if magic == _MAGIC else None
        if not isinstance(header, dict):
            return None
        whole = np.memmap(path, np.uint8, "r")
        at, arrays = _HEAD.size + length, []
        for size in header["bytes"]:
            arrays.append(whole[at : at + size])
            at += size + (-size % 8)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return (header, arrays) if at == len(whole) else None


def _load(path: pathlib.Path, root: str) -> FolderListing | None:
    """The kept listing at `path` mapped read-only, or None when there is none or it is of
    another folder, damaged or cut short (then it is listed again)."""
    mapped = _map_arrays(path)
    if mapped is None or mapped[0].get("root") != root.rstrip("/") or len(mapped[1]) != 5:
        return None
    header, (name_offsets, names, sizes, version_offsets, versions) = mapped
    if len(sizes) != 8 * header["count"]:
        return None
    return FolderListing(
        path,
        header["root"],
        header["listed_at"],
        _Flat(name_offsets.view(np.int64), names),
        sizes.view(np.int64),
        _Flat(version_offsets.view(np.int64), versions),
    )


def _load_derived(path: pathlib.Path, name: str) -> KeptArrays | None:
    """What was made of a listing for `name`, mapped, or None (then it is made again)."""
    mapped = _map_arrays(path)
    if mapped is None or mapped[0].get("name") != name:
        return None
    header, parts = mapped
    try:
        dtypes = [np.dtype(dtype) for dtype in header["dtypes"].values()]
        views = [part.view(dtype) for part, dtype in zip(parts, dtypes, strict=True)]
    except (KeyError, AttributeError, TypeError, ValueError):
        return None
    return KeptArrays(path, name, dict(zip(header["dtypes"], views, strict=True)), header.get("meta", {}))
