"""Which source reads a dataset as it is, from what its location holds: one table (`KINDS`).

`globalloader convert` opens its SOURCE through `open_source`. A location is a file or pattern
(`shards-{000..009}.tar`, `data/*.parquet`) or a folder, local or a URL; a row of `KINDS` says
whether it is of its kind from the location's name, the names in the folder and the small JSON
files there (a format's `index.json`, say), and makes the source. The first row that matches
wins: formats recognised by their own files come before those recognised by a suffix, and an
image folder, recognised by nothing else, comes last.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any, NamedTuple

from globalloader import storage
from globalloader.errors import ArgumentError, SourceError
from globalloader.sources.base import Source
from globalloader.sources.hf import HFDataset
from globalloader.sources.image_folder import ImageFolder
from globalloader.sources.lit_chunks import LitData
from globalloader.sources.mds import MDS
from globalloader.sources.parquet import Parquet
from globalloader.sources.tar_shards import TarShards

_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")  # gzip shards are streamed (no index)
_JSON_MAX = 64 << 20  # bytes: a larger file is not a small description of a dataset


class Location:
    """What detection may ask of a location, each answer fetched once."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None) -> None:
        self.url, self.storage_options = url.rstrip("/") or url, storage_options
        self.store = storage.Store(storage_options)
        self._json: dict[str, Any] = {}

    @cached_property
    def is_folder(self) -> bool:
        """A local directory, or a URL naming no file of a known suffix and no pattern."""
        if not storage.scheme_of(self.url):
            return os.path.isdir(self.url)
        return not self.suffix and not any(c in self.url for c in "*?[{")

    @cached_property
    def suffix(self) -> str:
        """The file name's suffix, lower case (`.tar`), or "" when it has none."""
        name = self.url.rsplit("/", 1)[-1]
        return os.path.splitext(name)[1].lower()

    @cached_property
    def names(self) -> frozenset[str]:
        """The names directly in the folder (empty for a file or pattern)."""
        if not self.is_folder:
            return frozenset()
        return frozenset(url.rstrip("/").rsplit("/", 1)[-1] for url in self.store.glob(self.join("*")))

    def join(self, name: str) -> str:
        return os.path.join(self.url, name) if not storage.scheme_of(self.url) else f"{self.url}/{name}"

    def json(self, name: str) -> Any:
        """The JSON file `name` in the folder, parsed, or None when there is none: for formats
        that a description file names (an `index.json`, a `state.json`)."""
        if name not in self._json:
            data = self.store.read_optional(self.join(name), _JSON_MAX) if name in self.names else None
            try:
                self._json[name] = None if data is None else json.loads(data)
            except ValueError as exc:
                raise SourceError(f"{self.join(name)} is not JSON ({exc})") from None
        return self._json[name]

    def holds(self, suffix: str) -> bool:
        """Whether the location is files of `suffix` (`.tar.gz` too), or a folder holding some."""
        return self.url.lower().endswith(suffix) or any(name.lower().endswith(suffix) for name in self.names)

    def files(self, suffix: str) -> str:
        """The location itself, or the pattern of the folder's files of `suffix`."""
        return self.join(f"*{suffix}") if self.is_folder else self.url


class Kind(NamedTuple):
    name: str
    matches: Callable[[Location], bool]
    make: Callable[[Location, list[str] | None], Source]  # with the columns to read, where the format has columns


def _index(at: Location, *keys: str) -> bool:
    """Whether the folder's `index.json` is an object holding `keys` (each format's own)."""
    index = at.json("index.json") if at.is_folder else None
    return isinstance(index, dict) and all(key in index for key in keys)


def _mds(at: Location) -> bool:
    shards = at.json("index.json").get("shards") if _index(at, "shards") else None
    return isinstance(shards, list) and all(isinstance(s, dict) and s.get("format") == "mds" for s in shards)


KINDS: list[Kind] = [
    Kind("Mosaic MDS", _mds, lambda at, _: MDS(at.url, **_remote(at))),
    Kind("LitData chunks", lambda at: _index(at, "chunks", "config"), lambda at, _: LitData(at.url, **_remote(at))),
    # save_to_disk's folder (a DatasetDict's too: HFDataset names its splits); local only.
    Kind(
        "Hugging Face dataset",
        lambda at: {"state.json", "dataset_info.json"} <= at.names or "dataset_dict.json" in at.names,
        lambda at, _: HFDataset(at.url),
    ),
    Kind(
        "tar shards",
        lambda at: any(at.holds(suffix) for suffix in _TAR_SUFFIXES),
        lambda at, _: TarShards(at.files(next(s for s in _TAR_SUFFIXES if at.holds(s))), **_remote(at)),
    ),
    Kind(
        "Parquet files",
        lambda at: at.holds(".parquet"),
        lambda at, columns: Parquet(at.files(".parquet"), columns=columns, **_remote(at)),
    ),
    Kind("image folder", lambda at: at.is_folder, lambda at, _: ImageFolder(at.url, **_remote(at))),
]


def _remote(at: Location) -> dict[str, Any]:
    return {"storage_options": at.storage_options}


def open_source(
    url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, columns: Sequence[str] | None = None
) -> tuple[str, Source]:
    """The kind of dataset at `url` (a row of `KINDS`) and the source that reads it as it is;
    SourceError naming `url` when no row matches. `columns`: only these are read where the
    format stores columns apart (Parquet: a remote file downloads the blocks they are in)."""
    if not isinstance(url, (str, os.PathLike)):
        raise ArgumentError(f"source must be a path or URL, got {type(url).__name__}")
    at = Location(os.fspath(url), storage_options)
    for kind in KINDS:
        if kind.matches(at):
            return kind.name, kind.make(at, list(columns) if columns is not None else None)
    known = ", ".join(kind.name for kind in KINDS)
    raise SourceError(f"{url}: no dataset globalloader can read is there (it reads {known})")
