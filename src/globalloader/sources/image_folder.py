"""ImageFolder: `root/class_name/file.jpg` trees as labelled records of encoded image bytes."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from globalloader.errors import ArgumentError
from globalloader.sources.files import Files

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".pgm", ".bmp", ".tif", ".tiff", ".webp")


class ImageFolder(Files):
    """Images under `root/<class>/...`, one record per file, labelled by sorted class order.

    `Files` over the image extensions, with labels: every sub-folder of `root` is a class (sorted,
    so labels match torchvision's ImageFolder); files are found recursively in each, sorted by
    path, matched case-insensitively on `extensions`; hidden ones (leading dot) are skipped. A
    record is `{"__key__": "class/stem", "image": bytes, "label": int}`: decoding is a later `map`,
    to run in workers and be cached. `root` may be a URL, listed once and read through the machine
    cache with downloads ahead of the reads, as `Files` says (its keyword arguments apply). A
    missing or empty root, or a file deleted after listing, is a SourceError naming it.
    `fingerprint` hashes every path, size and version (computed once, on first use).
    """

    _KIND = "ImageFolder"

    def __init__(
        self,
        root: str | os.PathLike[str],
        extensions: tuple[str, ...] = IMAGE_EXTENSIONS,
        **options: Any,
    ) -> None:
        if isinstance(extensions, str) or not all(isinstance(e, str) for e in extensions):
            raise ArgumentError(f"extensions must be a tuple of str, got {extensions!r}")
        self.extensions = tuple(e.lower() if e.startswith(".") else "." + e.lower() for e in extensions)
        self.classes: list[str] = []
        super().__init__(root, tuple("*" + e for e in self.extensions), **options)

    def _wanted(self, rel: str) -> bool:
        return "/" in rel and super()._wanted(rel)

    def _arrange(self, rows: list[int], name: Callable[[int], str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Grouped by class in sorted class order (a class is a folder of `root`), by path within
        one; the labels follow."""
        if self._listing is None:
            classes = sorted(e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith("."))
        else:
            classes = sorted({name(row).split("/", 1)[0] for row in rows})
        label_of = {c: i for i, c in enumerate(classes)}
        keyed = sorted((label_of[name(row).split("/", 1)[0]], name(row), row) for row in rows)
        arrays = {
            "rows": np.fromiter((row for _, _, row in keyed), np.int64, len(keyed)),
            "labels": np.fromiter((label for label, _, _ in keyed), np.int64, len(keyed)),
        }
        return arrays, {"classes": classes}

    def _adopt(self, meta: dict[str, Any]) -> None:
        self.classes = list(meta["classes"])

    @property
    def _labels(self) -> np.ndarray:
        return self._derived["labels"]

    def _record(self, index: int, rel: str, data: bytes) -> dict[str, Any]:
        return {"__key__": rel.rsplit(".", 1)[0], "image": data, "label": self._labels.item(index)}

    def _what(self) -> str:
        return "image folder"

    def _matching(self) -> str:
        return f"images with extensions {self.extensions}"

    def _layout(self) -> str:
        return "/<class>/ (expected the root/class_name/file layout)"

    @property
    def labels(self) -> np.ndarray:
        """Label of every record, in index order (for class-balanced samplers)."""
        return self._labels

    def __repr__(self) -> str:
        return f"ImageFolder({self.root!r}, {len(self)} images, {len(self.classes)} classes)"
