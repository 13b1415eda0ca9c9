"""URL lists (`sources._files`: braces, globs and the errors for wrong arguments) and the `Files`
source over a folder of small files (`sources.files`; remote folders in tests/storage)."""

from __future__ import annotations

import json
import os
import pathlib
import pickle

import numpy as np
import pytest

import globalloader as gl
from globalloader.errors import ArgumentError, SampleIndexError, SourceError
from globalloader.sources import Source, _files


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


@pytest.fixture
def folder(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "data"
    (root / "clips" / "deep").mkdir(parents=True)
    (root / ".hidden").mkdir()
    np.save(root / "a.npy", np.arange(3))
    (root / "b.json").write_text(json.dumps({"x": 1}))
    (root / "clips" / "c.WAV").write_bytes(b"RIFF....")
    (root / "clips" / "deep" / "d.wav").write_bytes(b"RIFF!!!!")
    (root / "clips" / ".e.wav").write_bytes(b"hidden")
    (root / ".hidden" / "f.wav").write_bytes(b"hidden")
    return root


def test_files_records_are_the_relative_path_and_the_raw_bytes(folder: pathlib.Path) -> None:
    src = gl.Files(folder)
    assert isinstance(src, Source) and not src.remote
    records = [src[i] for i in range(len(src))]
    assert [r["__key__"] for r in records] == ["a.npy", "b.json", "clips/c.WAV", "clips/deep/d.wav"]
    assert all(r["bytes"] == (folder / r["__key__"]).read_bytes() for r in records)
    wav = gl.Files(folder, "*.wav")  # case-insensitive; * crosses folders; hidden ones skipped
    assert [wav[i]["__key__"] for i in range(len(wav))] == ["clips/c.WAV", "clips/deep/d.wav"]
    some = gl.Files(folder, ("*.npy", "*.json"))
    assert [some.relative_path(i) for i in range(len(some))] == ["a.npy", "b.json"]
    clone = pickle.loads(pickle.dumps(wav))
    assert clone[1] == wav[1] and clone.fingerprint == wav.fingerprint


def test_files_fingerprint_follows_the_content(folder: pathlib.Path) -> None:
    first = gl.Files(folder).fingerprint
    assert gl.Files(folder).fingerprint == first
    (folder / "b.json").write_text(json.dumps({"x": 22}))
    os.utime(folder / "b.json", ns=(1, 1))
    assert gl.Files(folder).fingerprint != first


def test_files_errors_name_the_folder_the_pattern_or_the_file(folder: pathlib.Path) -> None:
    with pytest.raises(SourceError, match=f"file folder not found: {folder / 'nope'}"):
        gl.Files(folder / "nope")
    with pytest.raises(SourceError, match=f"no files matching '\\*.flac' under {folder}"):
        gl.Files(folder, "*.flac")
    with pytest.raises(ArgumentError, match="pattern"):
        gl.Files(folder, ["*.wav"])  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="root"):
        gl.Files(3)  # type: ignore[arg-type]
    src = gl.Files(folder)
    (folder / "b.json").unlink()
    with pytest.raises(SourceError, match=f"cannot read file {folder / 'b.json'}"):
        src[1]
    with pytest.raises(SampleIndexError):
        src[4]
