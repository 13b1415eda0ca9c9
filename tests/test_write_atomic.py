"""globalloader._paths.write_atomic: a file is written whole or not at all, by any number of
processes, whatever happens to the writer."""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import signal

import pytest

from globalloader._paths import temporary_writer, write_atomic
from globalloader._pids import alive

_FORK = multiprocessing.get_context("fork")
_SIZE = 1 << 20


def _write_then_hang(path: pathlib.Path, started: multiprocessing.synchronize.Event) -> None:
    with write_atomic(path, durable=True) as out:
        out.write(b"n" * _SIZE)
        out.file.flush()  # half a file on disk, under the temporary name
        started.set()
        signal.pause()  # killed here


def test_a_writer_killed_mid_write_leaves_the_old_file_whole(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "data.bin"
    with write_atomic(path) as out:
        out.write(b"old")
    started = _FORK.Event()
    writer = _FORK.Process(target=_write_then_hang, args=(path, started))
    writer.start()
    try:
        assert started.wait(60), "the writer never started writing"
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(60)
    assert path.read_bytes() == b"old"
    (left,) = [p for p in tmp_path.iterdir() if p != path]
    assert left.stat().st_size == _SIZE  # the half-written temporary, never under the final name
    assert temporary_writer(left.name) == writer.pid and not alive(writer.pid)  # a cleaner may remove it


@pytest.mark.parametrize("existed", [True, False])
def test_an_exception_mid_write_leaves_no_temporary_and_the_file_as_it_was(
    tmp_path: pathlib.Path, existed: bool
) -> None:
    path = tmp_path / "data.bin"
    if existed:
        path.write_bytes(b"old")

    def fail_mid_write() -> None:
        with write_atomic(path, durable=True) as out:
            out.write(b"new" * 1000)
            out.file.flush()
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        fail_mid_write()
    assert sorted(tmp_path.iterdir()) == ([path] if existed else [])
    if existed:
        assert path.read_bytes() == b"old"


def _write_many(path: pathlib.Path, byte: int, start: multiprocessing.synchronize.Barrier) -> None:
    start.wait(60)
    for _ in range(20):
        with write_atomic(path) as out:
            for _ in range(4):  # in pieces: a reader would see a partial file if it were ever published
                out.write(bytes([byte]) * (_SIZE // 4))


def test_concurrent_writers_in_processes_end_with_one_whole_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "data.bin"
    start = _FORK.Barrier(4)
    writers = [_FORK.Process(target=_write_many, args=(path, byte, start)) for byte in range(1, 5)]
    for writer in writers:
        writer.start()
    seen = set()
    while any(writer.is_alive() for writer in writers):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        assert len(data) == _SIZE and data == data[:1] * _SIZE  # whole, and one writer's
        seen.add(data[0])
    for writer in writers:
        writer.join(60)
        assert writer.exitcode == 0
    data = path.read_bytes()
    assert len(data) == _SIZE and data == data[:1] * _SIZE and data[0] in range(1, 5)
    assert list(tmp_path.iterdir()) == [path]  # no temporary left behind


def test_any_name_that_fits_the_folder_can_be_written(tmp_path: pathlib.Path) -> None:
    path = tmp_path / ("n" * 250 + ".html")  # 255 bytes: the temporary name is shortened, not refused
    with write_atomic(path) as out:
        out.write(b"page")
    assert path.read_bytes() == b"page" and list(tmp_path.iterdir()) == [path]


def test_an_exact_mode_ignores_the_umask_and_no_link_is_followed(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "entry"
    old = os.umask(0o077)
    try:
        with write_atomic(path, mode=0o640) as out:
            out.write(b"x")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640
    target = tmp_path / "elsewhere"
    path.unlink()
    path.symlink_to(target)
    with write_atomic(path) as out:  # the link is replaced by the file, never written through
        out.write(b"y")
    assert not target.exists() and not path.is_symlink() and path.read_bytes() == b"y"
