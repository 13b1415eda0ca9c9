"""Local and fsspec URLs through the Store and RangeReader: stat, ranged reads, pickling, fork."""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import pickle

import fsspec
import pytest

from globalloader import storage
from globalloader.errors import SourceError


def test_scheme_of() -> None:
    assert storage.scheme_of("/data/a.tar") == ""
    assert storage.scheme_of("rel/a.tar") == ""
    assert storage.scheme_of("s3://bucket/a.tar") == "s3"
    assert storage.scheme_of("dir/x://y") == ""


def test_stat_local_and_remote(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"12345")
    assert storage.Store().stat(str(path)) == (5, str(path.stat().st_mtime_ns))
    assert storage.Store().stat(f"file://{path}").size == 5
    url = f"memory://{tmp_path.name}/g.bin"
    with fsspec.open(url, "wb") as f:
        f.write(b"123")
    assert storage.Store().stat(url).size == 3 and storage.Store().stat(url).version
    for missing in (str(tmp_path / "none"), f"memory://{tmp_path.name}/none"):
        with pytest.raises(SourceError, match=f"file not found: {missing}"):
            storage.Store().stat(missing)
    with pytest.raises(SourceError, match="not a regular file"):
        storage.Store().stat(str(tmp_path))


def test_range_reader_local_remote_and_pickle(tmp_path: pathlib.Path) -> None:
    data = os.urandom(5000)
    path = str(tmp_path / "r.bin")
    pathlib.Path(path).write_bytes(data)
    url = f"memory://{tmp_path.name}/r.bin"
    with fsspec.open(url, "wb") as f:
        f.write(data)
    reader = storage.RangeReader(max_open=1)
    for source in (path, url):
        assert reader.read(source, 100, 50) == data[100:150]
        assert reader.read(source, 4990, 50) == data[4990:]  # short only at the end
    other = str(tmp_path / "other.bin")
    pathlib.Path(other).write_bytes(b"other")
    assert reader.read(other, 0, 5) == b"other"  # beyond max_open: open, read, close
    assert list(reader._fds) == [path]
    clone = pickle.loads(pickle.dumps(reader))
    assert clone._fds == {} and clone.read(path, 0, 10) == data[:10]
    with pytest.raises(SourceError, match="file not found"):
        reader.read(str(tmp_path / "gone.bin"), 0, 1)
    reader.close()


def test_range_reader_reopens_after_fork(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "r.bin")
    pathlib.Path(path).write_bytes(b"abcdef")
    reader = storage.RangeReader()
    assert reader.read(path, 0, 3) == b"abc"
    parent_fd = reader._fds[path]
    pipe_out, pipe_in = multiprocessing.Pipe(duplex=False)

    def child() -> None:
        pipe_in.send((reader.read(path, 3, 3), reader._pid == os.getpid(), path in reader._fds))

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    assert pipe_out.recv() == (b"def", True, True)
    proc.join(30)
    assert reader._fds[path] == parent_fd and reader.read(path, 0, 2) == b"ab"
