"""Files: any folder of small files (images, `.npy`, `.json`, audio clips) as records of raw bytes."""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from globalloader import storage
from globalloader.errors import ArgumentError, SourceError
from globalloader.sources.base import check_index, fingerprint_of
from globalloader.storage.listing import FolderListing, KeptArrays, flat_strings


class Files:
    """Every file below `root` whose path relative to it matches `pattern` (a glob or a tuple of
    globs, matched case-insensitively; `*` crosses folders), sorted by path; hidden files and
    folders (leading dot) are skipped. A record is `{"__key__": "sub/name.ext", "bytes": raw}`:
    the whole relative path, suffix included, so `a.jpg` and `a.json` are two records (this is one
    record per file, not WebDataset's grouping of a sample's files by stem). Decoding is a later
    `map`, run in workers.

    `root` may be a URL (`storage_options=`, `cache_limit=`, `fetch_concurrency=`,
    `fetch_memory=` go to its `storage.Store`): one listing finds every file, kept in the cache
    folder as flat arrays that the workers map instead of copying (`listing_max_age=`: reuse a
    listing made this many seconds ago by any job of the machine; see `storage.listing`), and so
    are the rows this source takes of it (and an ImageFolder's labels); each file is read through
    the machine cache with the ETag of its listing and downloaded ahead of the reads by the pool
    of many requests in flight (`prefetch`, `storage.fetch_ahead`). A missing or empty root is a
    SourceError; a file deleted since the listing is an error naming it.
    """

    _KIND = "Files"

    def __init__(
        self,
        root: str | os.PathLike[str],
        pattern: str | tuple[str, ...] = "*",
        *,
        storage_options: dict[str, Any] | None = None,
        cache_limit: int | str | None = None,
        listing_max_age: float | None = None,
        fetch_concurrency: int | str | None = None,
        fetch_memory: int | str | None = None,
    ) -> None:
        if not isinstance(root, (str, os.PathLike)):
            raise ArgumentError(f"root must be a str or path, got {type(root).__name__}")
        patterns = (pattern,) if isinstance(pattern, str) else pattern
        if not isinstance(patterns, tuple) or not patterns or not all(isinstance(p, str) for p in patterns):
            raise ArgumentError(f"pattern must be a str or a tuple of str, got {pattern!r}")
        self.root = os.fspath(root)
        self.patterns = tuple(p.lower() for p in patterns)
        self._listing: FolderListing | None = None
        self._derived: dict[str, np.ndarray] | KeptArrays
        if storage.scheme_of(self.root):
            self.root = self.root.rstrip("/")
            self.store = storage.Store(
                storage_options, cache_limit, fetch_concurrency=fetch_concurrency, fetch_memory=fetch_memory
            )
            listing = self._listing = FolderListing.of(self.store, self.root, listing_max_age)
            # Which rows, in which order: made once per machine for this listing and kept beside it.
            self._derived = listing.derived(
                f"{self._KIND} 1 {self.patterns}", lambda: self._derive(len(listing), listing.names.__getitem__)
            )
            self._adopt(self._derived.meta)
        else:
            if not os.path.isdir(self.root):
                raise SourceError(f"{self._what()} not found: {self.root}")
            self.store = storage.Store()
            found = sorted(rel for rel in _walk(self.root) if self._wanted(rel))
            self._local_names = flat_strings(found)
            self._derived, meta = self._derive(len(found), found.__getitem__)
            self._adopt(meta)
        if not len(self._rows):
            raise SourceError(f"no {self._matching()} under {self.root}{self._layout()}")
        self._fingerprint: str | None = None

    @property
    def _rows(self) -> np.ndarray:
        """Listing row of each record, in index order (mapped from the kept file when remote)."""
        return self._derived["rows"]

    def _derive(self, count: int, name: Callable[[int], str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The arrays (`rows`: the wanted ones of `count` names, in this source's order) and the
        JSON-able meta this source makes of its names."""
        return self._arrange([i for i in range(count) if self._wanted(name(i))], name)

    @property
    def _names(self) -> Any:
        """Relative names by listing row: the kept listing's (sent to a worker as its file's
        path, mapped there), or a local folder's, in memory."""
        return self._listing.names if self._listing is not None else self._local_names

    # What a subclass (ImageFolder) changes: which files, their order, the record, the words.
    def _wanted(self, rel: str) -> bool:
        lowered = rel.lower()
        return not _hidden(rel) and any(fnmatch.fnmatchcase(lowered, p) for p in self.patterns)

    def _arrange(self, rows: list[int], name: Callable[[int], str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        return {"rows": np.asarray(rows, np.int64)}, {}

    def _adopt(self, meta: dict[str, Any]) -> None:
        """Take what `_arrange` said besides its arrays (a subclass's class names)."""

    def _record(self, index: int, rel: str, data: bytes) -> dict[str, Any]:
        return {"__key__": rel, "bytes": data}

    def _what(self) -> str:
        return "file folder"

    def _matching(self) -> str:
        return f"files matching {self.patterns if len(self.patterns) > 1 else self.patterns[0]!r}"

    def _layout(self) -> str:
        return ""

    def __len__(self) -> int:
        return len(self._rows)

    def relative_path(self, index: int) -> str:
        """The path of record `index` relative to `root`, with '/' separators."""
        return self._names[self._rows.item(index)]

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index.__class__ is not int or not 0 <= index < len(self._rows):
            index = check_index(index, len(self._rows), self)
        row = self._rows.item(index)
        rel = self._names[row]
        if self._listing is None:
            path = os.path.join(self.root, rel)
            try:
                data = storage.read_whole(path)
            except OSError as exc:
                raise SourceError(f"cannot read {self._what().split()[0]} {path}: {exc.strerror}") from None
        else:
            stat = storage.FileStat(self._listing.sizes.item(row), self._listing.versions[row])
            data = self.store.read_object(f"{self.root}/{rel}", stat)
        return self._record(index, rel, data)

    @property
    def remote(self) -> bool:
        """Whether the files are read through the machine cache (so `prefetch` has work to do)."""
        return self._listing is not None and self.store.cached(self.root)

    def prefetch(self, indices: Any) -> None:
        """Download the files at these indices into the machine cache in the background."""
        if self._listing is None or not self.remote:
            return
        listing, objects = self._listing, []
        for row in self._rows[np.asarray(indices, dtype=np.int64)].tolist():
            stat = storage.FileStat(listing.sizes.item(row), listing.versions[row])
            objects.append((f"{self.root}/{listing.names[row]}", stat))
        self.store.prefetch(objects)

    @property
    def fingerprint(self) -> str:
        """A hash of every path with its size and version (ETag; mtime for local files),
        computed once, on first use."""
        if self._fingerprint is None:
            lines = []
            for row in self._rows.tolist():
                rel = self._names[row]
                if self._listing is not None:
                    lines.append(f"{rel}\t{self._listing.sizes.item(row)}\t{self._listing.versions[row]}")
                    continue
                try:
                    st = os.stat(os.path.join(self.root, rel))
                except OSError:
                    raise SourceError(f"file vanished: {os.path.join(self.root, rel)}") from None
                lines.append(f"{rel}\t{st.st_size}\t{st.st_mtime_ns}")
            root = self.root if self._listing is not None else os.path.abspath(self.root)
            self._fingerprint = fingerprint_of(self._KIND, [root, *sorted(lines)])
        return self._fingerprint

    def __repr__(self) -> str:
        return f"Files({self.root!r}, {len(self)} {self._matching()})"


def _hidden(rel: str) -> bool:
    return rel.startswith(".") or "/." in rel


def _walk(root: str) -> list[str]:
    """Every file below the local folder `root`, relative to it with '/' separators, not
    descending into hidden folders (links to folders are followed)."""
    found = []
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        rel = os.path.relpath(folder, root).replace(os.sep, "/")
        prefix = "" if rel == "." else rel + "/"
        found += [prefix + f for f in files if not f.startswith(".")]
    return found
