"""The server's arena as a job process maps it: by file, not by name, and unmapped when released."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from globalloader.errors import ServerGoneError
from globalloader.transport import arena, names
from helpers import shm_held


def write(target: arena.Arena, value: int) -> tuple[int, object]:
    """Put one sample of `value`s at offset 0; its layout."""
    layout, placed = arena.encode({"x": np.full(4, value)})
    target.write(0, placed)
    return layout


def test_a_name_made_again_is_never_read_through_the_earlier_files_mapping():
    """A server in its own PID namespace is pid 1 at every start: its arena's name comes back. Here
    this process is the server twice (`create` names the arena after our pid) and a job in between."""
    first = arena.create(1 << 16)
    layout = write(first, 7)
    job = arena.hold(first.id)
    assert job.read(0, layout)["x"].tolist() == [7] * 4
    first.close()  # the server stops (its arena unlinked); the job has not let go yet
    second = arena.create(1 << 16)
    try:
        assert second.name == first.name and second.id != first.id
        write(second, 9)
        again = arena.hold(second.id)
        assert again is not job and again.read(0, layout)["x"].tolist() == [9] * 4
        assert arena.attach(second.id) is again  # a worker of this process reads the same, new file
        with pytest.raises(ServerGoneError, match=first.name):
            arena.attach(first.id)  # its file is gone: the new one under its name is not it
        again.release()
        job.release()
    finally:
        second.close()
    assert shm_held(first.name) == (0, 0)


def test_the_last_release_unmaps_and_a_kept_view_keeps_its_bytes():
    owner = arena.create(1 << 16)
    try:
        layout = write(owner, 5)
        train, val = arena.hold(owner.id), arena.hold(owner.id)
        # the server's mapping and ours, each with its fd, and the server's lock that says it lives
        assert train is val and shm_held(owner.name) == (3, 2)
        train.release()
        assert shm_held(owner.name) == (3, 2), "released while another session held it"
        kept = val.read(0, layout)["x"]  # a view a reader still holds
        val.release()
        assert kept.tolist() == [5] * 4 and shm_held(owner.name) == (3, 2)  # not unmapped under it
        del kept
        assert shm_held(owner.name) == (2, 1)  # the view gone, our mapping and descriptor with it
    finally:
        owner.close()
    assert shm_held(owner.name) == (0, 0)


_HOLDER = """
import sys
from globalloader.transport import names
names.create_mapping(sys.argv[1], 1 << 12, hold=True)
print("ready", flush=True)
sys.stdin.read()  # until told to stop; then it dies without unlinking
"""


@pytest.fixture
def live_holder():
    """Start a process holding an arena name of our choosing, as a server of another PID namespace
    does (its name says nothing about its pid here); yields a function taking the name."""
    started: list[tuple[subprocess.Popen[str], str]] = []

    def start(name: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        started.append((proc, name))
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n", "the holder did not start"
        return proc

    yield start
    for proc, name in started:
        proc.kill()
        proc.communicate(timeout=10)
        names.unlink(name)


def test_the_sweep_keeps_a_pool_a_live_process_holds_whatever_pid_its_name_says(live_holder):
    """A server's sweep at start (`remove_unheld`) goes by the arena's lock, not by the pid in its
    name: a sidecar server in another PID namespace names its arena after a pid that is dead here
    (or another process's), and its arena must survive; the arena of a server that died goes."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live, leftover = f"{arena.ARENA_PREFIX}{dead.pid}", f"{arena.ARENA_PREFIX}{dead.pid}-gone"
    holder = live_holder(live)
    names.create_mapping(leftover, 1 << 12)  # nobody holds it: a dead server's
    assert names.remove_unheld(arena.ARENA_PREFIX + str(dead.pid)) == 1
    assert names.list_names(live) == [live]
    holder.kill()  # the sidecar dies: its lock goes with it
    holder.communicate(timeout=10)
    assert names.remove_unheld(live) == 1 and names.list_names(live) == []


def test_the_sweep_never_touches_another_users_pool():
    name = f"{arena.ARENA_PREFIX}0-other-user"
    names.create_mapping(name, 1 << 12)
    try:
        if os.geteuid() == 0:  # only root can give a file to another user
            os.chown(os.path.join(names.SHM_DIR, name), 65534, -1)
            assert names.remove_unheld(name) == 0 and names.list_names(name) == [name]
        else:
            assert names.remove_unheld(name) == 1
    finally:
        names.unlink(name)


def test_a_server_whose_pid_names_a_live_pool_makes_its_own(live_holder):
    """Two servers of two PID namespaces with the same pid, alive together: the second never
    takes or unlinks the first's arena, and each reads its own values."""
    theirs = f"{arena.ARENA_PREFIX}{os.getpid()}"
    live_holder(theirs)
    ours = arena.create(1 << 16)
    try:
        assert ours.name.startswith(theirs + "-") and names.list_names(theirs)[0] == theirs
        layout = write(ours, 5)
        assert arena.attach(ours.id).read(0, layout)["x"].tolist() == [5] * 4
    finally:
        ours.close()
    assert names.list_names(ours.name) == [] and names.list_names(theirs)[0] == theirs


WRITER = """
import resource, sys
import numpy as np
from globalloader.transport import arena
pool = arena.attach(arena.ArenaId(sys.argv[1], int(sys.argv[2])))
layout, placed = arena.encode({"x": np.arange(1 << 20, dtype=np.int32)})  # 4 MiB: 1,024 pages
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
pool.write(0, placed)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _kernel() -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", os.uname().release)[:2])


@pytest.mark.skipif(sys.platform != "linux" or _kernel() < (5, 14), reason="MADV_POPULATE_READ: Linux 5.14")
def test_a_worker_writing_a_sample_into_the_pool_maps_its_pages_without_a_fault_each():
    """A decode worker's first write to each page of the pool used to fault once per 4 KiB page
    (0.3 CPU s per GB written, as much as decoding 300 small JPEGs)."""
    owner = arena.create(8 << 20)
    try:
        out = subprocess.run(
            [sys.executable, "-c", WRITER, owner.id.name, str(owner.id.inode)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert out.returncode == 0, out.stderr
        assert int(out.stdout) < 1024 // 4, f"{out.stdout.strip()} page faults writing 1,024 pages"
        layout = arena.encode({"x": np.zeros(1 << 20, dtype=np.int32)})[0]
        assert np.array_equal(owner.read(0, layout)["x"], np.arange(1 << 20, dtype=np.int32))
    finally:
        owner.close()
