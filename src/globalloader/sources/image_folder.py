"""ImageFolder: `root/class_name/file.jpg` trees as labelled records of encoded image bytes."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from globalloader import storage
from globalloader.errors import ArgumentError, SourceError
from globalloader.sources.base import check_index, fingerprint_of

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".pgm", ".bmp", ".tif", ".tiff", ".webp")


class ImageFolder:
    """Images under `root/<class>/...`, one record per file, labelled by sorted class order.

    Every sub-folder of `root` is a class (sorted, so labels match torchvision's ImageFolder);
    files are found recursively in each, sorted by path, matched case-insensitively on
    `extensions`; hidden ones (leading dot) are skipped. A record is `{"__key__": "class/stem",
    "image": bytes, "label": int}`: decoding is a later `map`, to run in workers and be cached.
    `root` may be a URL (`storage_options=` go to fsspec): one listing finds every file, each read
    through the machine-wide cache (`cache_limit=`) and downloaded ahead of the reads (`prefetch`).
    A missing or empty root, or a file deleted after listing, is a SourceError naming it.
    `fingerprint` hashes every path, size and mtime (computed once, on first use).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        extensions: tuple[str, ...] = IMAGE_EXTENSIONS,
        *,
        storage_options: dict[str, Any] | None = None,
        cache_limit: int | str | None = None,
    ) -> None:
        if not isinstance(root, (str, os.PathLike)):
            raise ArgumentError(f"root must be a str or path, got {type(root).__name__}")
        if isinstance(extensions, str) or not all(isinstance(e, str) for e in extensions):
            raise ArgumentError(f"extensions must be a tuple of str, got {extensions!r}")
        self.root = os.fspath(root)
        self.extensions = tuple(e.lower() if e.startswith(".") else "." + e.lower() for e in extensions)
        self._remote: dict[str, storage.FileStat] | None = None  # relative path -> size, version
        self._reader: storage.RangeReader | None = None
        if storage.scheme_of(self.root):
            self.root = self.root.rstrip("/")
            self.store = storage.Store(storage_options, cache_limit)
            self._remote = self._list_remote()
            self.classes: list[str] = sorted({rel.split("/", 1)[0] for rel in self._remote})
        else:
            if not os.path.isdir(self.root):
                raise SourceError(f"image folder not found: {self.root}")
            self.classes = sorted(e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith("."))
        paths: list[str] = []
        labels: list[int] = []
        for label, name in enumerate(self.classes):
            found = sorted(
                self._walk(name) if self._remote is None else (r for r in self._remote if r.startswith(name + "/"))
            )
            paths.extend(found)
            labels.extend([label] * len(found))
        if not paths:
            raise SourceError(
                f"no images with extensions {self.extensions} under {self.root}/"
                "<class>/ (expected the root/class_name/file layout)"
            )
        self._paths = paths  # relative to root, with '/' separators
        self._labels = np.asarray(labels, np.int64)
        self._fingerprint: str | None = None

    def _list_remote(self) -> dict[str, storage.FileStat]:
        """Every image below a class folder of the remote root, from one listing."""
        found = {}
        for url, stat in self.store.find(self.root).items():
            rel = url[len(self.root) + 1 :]
            parts = rel.split("/")
            if len(parts) >= 2 and not any(p.startswith(".") for p in parts) and rel.lower().endswith(self.extensions):
                found[rel] = stat
        if not found:
            raise SourceError(f"image folder not found or empty: {self.root}")
        return found

    def _walk(self, class_name: str) -> list[str]:
        found = []
        for folder, dirs, files in os.walk(os.path.join(self.root, class_name), followlinks=True):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            rel = os.path.relpath(folder, self.root).replace(os.sep, "/")
            found += [f"{rel}/{f}" for f in files if not f.startswith(".") and f.lower().endswith(self.extensions)]
        return found

    def __len__(self) -> int:
        return len(self._paths)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index.__class__ is not int or not 0 <= index < len(self._paths):
            index = check_index(index, len(self._paths), self)
        rel = self._paths[index]
        if self._remote is not None:
            data = self._read_remote(rel)
        else:
            path = os.path.join(self.root, rel)
            try:
                data = storage.read_whole(path)
            except OSError as exc:
                raise SourceError(f"cannot read image {path}: {exc.strerror}") from None
        return {"__key__": rel.rsplit(".", 1)[0], "image": data, "label": int(self._labels[index])}

    def _read_remote(self, rel: str) -> bytes:
        assert self._remote is not None
        if self._reader is None:
            self._reader = storage.RangeReader(self.store, whole=True)
        url, stat = f"{self.root}/{rel}", self._remote[rel]
        self._reader.expect(url, stat)
        data = self._reader.read_remote(url, 0, stat.size)
        if len(data) != stat.size:
            raise SourceError(f"image {url} has {len(data)} bytes, its listing said {stat.size}")
        return data

    @property
    def remote(self) -> bool:
        """Whether the images are read through the machine cache (so `prefetch` has work to do)."""
        return self._remote is not None and self.store.cached(self.root)

    def prefetch(self, indices: Any) -> None:
        """Download the images at these indices into the machine cache in the background."""
        if self._remote is not None and self.remote:
            rels = [self._paths[i] for i in np.asarray(indices, dtype=np.int64).tolist()]
            self.store.prefetch([(f"{self.root}/{rel}", self._remote[rel]) for rel in rels])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_reader"] = None  # open cache entries stay with this process
        return state

    @property
    def labels(self) -> np.ndarray:
        """Label of every record, in index order (for class-balanced samplers)."""
        return self._labels

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None and self._remote is not None:
            lines = [f"{rel}\t{st.size}\t{st.version}" for rel, st in sorted(self._remote.items())]
            self._fingerprint = fingerprint_of("ImageFolder", [self.root, *lines])
        if self._fingerprint is None:
            lines = []
            for rel in self._paths:
                try:
                    st = os.stat(os.path.join(self.root, rel))
                except OSError:
                    raise SourceError(f"image file vanished: {os.path.join(self.root, rel)}") from None
                lines.append(f"{rel}\t{st.st_size}\t{st.st_mtime_ns}")
            self._fingerprint = fingerprint_of("ImageFolder", [os.path.abspath(self.root), *lines])
        return self._fingerprint

    def __repr__(self) -> str:
        return f"ImageFolder({self.root!r}, {len(self._paths)} images, {len(self.classes)} classes)"
