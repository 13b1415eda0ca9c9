"""The server's arena as a job process maps it: by file, not by name, and unmapped when released."""

from __future__ import annotations

import numpy as np
import pytest

from globalloader.errors import ServerGoneError
from globalloader.transport import arena
from helpers import shm_held


def write(pool: arena.Arena, value: int) -> tuple[int, object]:
    """Put one sample of `value`s at offset 0; its layout."""
    layout, placed = arena.encode({"x": np.full(4, value)})
    pool.write(0, placed)
    return layout


def test_a_name_made_again_is_never_read_through_the_earlier_files_mapping():
    """A server in its own PID namespace is pid 1 at every start: its pool's name comes back. Here
    this process is the server twice (`create` names the pool after our pid) and a job in between."""
    first = arena.create(1 << 16)
    layout = write(first, 7)
    job = arena.hold(first.id)
    assert job.read(0, layout)["x"].tolist() == [7] * 4
    first.close()  # the server stops (its pool unlinked); the job has not let go yet
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
        assert train is val and shm_held(owner.name) == (2, 2)  # the server's mapping and ours, each with its fd
        train.release()
        assert shm_held(owner.name) == (2, 2), "released while another session held it"
        kept = val.read(0, layout)["x"]  # a view a reader still holds
        val.release()
        assert kept.tolist() == [5] * 4 and shm_held(owner.name) == (2, 2)  # not unmapped under it
        del kept
        assert shm_held(owner.name) == (1, 1)  # the view gone, our mapping and descriptor with it
    finally:
        owner.close()
    assert shm_held(owner.name) == (0, 0)
