"""globalloader._paths.write_atomic: a file is written whole or not at all, by any number of
processes, whatever happens to the writer."""

from __future__ import annotations

import errno
import multiprocessing
import os
import pathlib
import random
import resource
import signal
import threading
from typing import Any

import pytest

from globalloader import _paths
from globalloader._paths import temporary_writer, write_atomic, write_whole
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


def _write_whole_under_a_size_limit(path: pathlib.Path, limit: int, out: Any) -> None:
    """In a child: files of this process may not grow beyond `limit` bytes (the kernel refuses
    the write midway, EFBIG, as a full disk would); what `write_whole` of more raises."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error from write(), not a signal that kills
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        # The kernel takes `limit` bytes of the first part (a short write), then refuses the rest.
        write_whole(path, (b"n" * (limit + 100), b"t" * limit), mode=0o600)
    except OSError as exc:
        out.put(exc.errno)
    else:
        out.put(None)


def test_write_whole_puts_the_bytes_and_times_at_once_and_a_refused_write_leaves_the_old_file(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "entry"
    write_whole(path, (b"o", b"", b"ld"), mode=0o640, times=(2 * 10**18, 10**18))  # parts in order
    st = path.stat()
    assert path.read_bytes() == b"old" and st.st_mode & 0o777 == 0o640
    assert (st.st_atime_ns, st.st_mtime_ns) == (2 * 10**18, 10**18)
    out = _FORK.Queue()
    child = _FORK.Process(target=_write_whole_under_a_size_limit, args=(path, 4096, out))
    child.start()
    child.join(60)
    assert child.exitcode == 0 and out.get(timeout=10) == errno.EFBIG
    assert path.read_bytes() == b"old" and list(tmp_path.iterdir()) == [path]  # no temporary left


def test_write_whole_goes_on_after_short_writes_within_and_across_its_parts(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A regular file takes fewer bytes than asked only at a limit (a full disk, a size limit) or
    when a signal interrupts a long write, which no test can time; so the kernel's writev is made
    to take at most 3 bytes a call (through the real call), and every byte must land once, in order."""
    real = os.writev

    def three_bytes_at_most(fd: int, buffers: Any) -> int:
        taken, left = [], 3
        for buffer in buffers:
            if left:
                taken.append(buffer[:left])
                left -= len(taken[-1])
        return real(fd, taken)

    monkeypatch.setattr(os, "writev", three_bytes_at_most)
    path = tmp_path / "entry"
    write_whole(path, (b"abcde", b"", b"f", b"ghijklm"), mode=0o600)
    assert path.read_bytes() == b"abcdefghijklm"


def _token(path: str) -> str:
    """The random token of a temporary file's name (see `temporary_mark`)."""
    return path.rpartition(".tmp")[0].rsplit(".", 1)[-1]


def _token_in_child(folder: pathlib.Path, out: Any) -> None:
    name = os.path.basename(_paths._temporary_for(folder / "a"))
    out.put((_token(name), _paths.temporary_writer(name), os.getpid()))


def test_writing_files_leaves_random_alone_and_a_forked_child_draws_other_tokens(tmp_path: pathlib.Path) -> None:
    """The temporary files' names take no bits of `random`'s generator (the user's: a seeded job's
    sequence, a state a resume saved), and a forked child does not repeat its parent's tokens
    nor name its parent as their writer (a cleaner would judge the child's files by the parent's
    pid); each thread names itself."""
    threads: list[str] = []
    worker = threading.Thread(target=lambda: threads.append(_paths._temporary_for(tmp_path / "a")))
    worker.start()
    worker.join()
    assert f"-{os.getpid()}-{worker.native_id}." in threads[0]
    assert f"-{os.getpid()}-{threading.get_native_id()}." in _paths._temporary_for(tmp_path / "a")
    random.seed(7)
    state = random.getstate()
    write_whole(tmp_path / "whole", (b"w",), mode=0o600)
    with write_atomic(tmp_path / "atomic") as out:
        out.write(b"a")
    assert random.getstate() == state
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_token_in_child, args=(tmp_path, out))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    token, writer, pid = out.get(timeout=5)
    assert token != _token(_paths._temporary_for(tmp_path / "a"))
    assert writer == pid != os.getpid()
