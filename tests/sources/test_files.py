"""URL lists: braces, globs and the errors for wrong arguments."""

from __future__ import annotations

import pathlib

import pytest

from globalloader.errors import ArgumentError, SourceError
from globalloader.sources import _files


def test_expand_urls(tmp_path: pathlib.Path) -> None:
    for name in ("a-0.bin", "a-1.bin", "b.bin"):
        (tmp_path / name).write_bytes(b"x")
    folder = str(tmp_path)
    assert _files.expand_urls(folder + "/a-{0..1}.bin", "urls") == [folder + "/a-0.bin", folder + "/a-1.bin"]
    assert _files.expand_urls([tmp_path / "b.bin", folder + "/a-*.bin"], "urls") == [
        folder + "/b.bin",
        folder + "/a-0.bin",
        folder + "/a-1.bin",
    ]
    with pytest.raises(SourceError, match=r"no file matches .*c-\*"):
        _files.expand_urls(folder + "/c-*.bin", "urls")
    with pytest.raises(ArgumentError, match="files is empty"):
        _files.expand_urls([], "files")
    with pytest.raises(ArgumentError, match="files items must be str"):
        _files.expand_urls([1], "files")
